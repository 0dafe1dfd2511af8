"""The Triton GPU kernels against their torch references, on fresh random inputs over shape
grids: on CUDA when present, else in Triton's interpreter on the CPU (same kernel code)."""
import numpy as np
import pytest
import torch
from tiny import kernel_device

from ktransformers.cache.paged import pad_slots
from ktransformers.operators.experts import moe_reference
from ktransformers.weights import ggml_quants as gq

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def dev():
    return kernel_device()


def tol(dev: str) -> float:
    return 2e-2 if dev == "cuda" else 1e-5  # bf16 tensor-core dots on the GPU, float32 in the interpreter


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def gen(seed):
    return torch.Generator().manual_seed(seed)


def gguf_dequantize(raw: torch.Tensor, t, shape, dtype=torch.float32) -> torch.Tensor:
    """gguf-py's numpy dequantization of the blocks `raw` (uint8), as a [shape] tensor of dtype:
    the independent reference (float32, then one rounding to dtype)."""
    from gguf import quants
    from gguf.constants import GGMLQuantizationType
    values = quants.dequantize(raw.cpu().numpy().reshape(-1, gq.FORMATS[t].block_bytes), GGMLQuantizationType(int(t)))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape).to(dtype)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_K", "Q8_0", "Q6_K", "int4", "int8"])
@pytest.mark.parametrize("M", [1, 3, 17, 128])
def test_group_gemm(dev, fmt, M):
    from ktransformers.kernels.triton import quant_linear as ql
    for N, K in ((96, 256), (200, 1024)):
        g = gen(M * N + K)
        if fmt in ("int4", "int8"):
            dense = torch.randn(N, K, generator=g)
            w = (ql.quantize_int4 if fmt == "int4" else ql.quantize_int8)(dense)
            ref_w = w.dequantize()
            assert rel_err(ref_w, dense) < (0.1 if fmt == "int4" else 0.01)  # the re-quantization is close
        else:
            t = gq.ggml_type(fmt)
            raw = gq.random_blocks(t, N * K // gq.FORMATS[t].block_elems, g)
            w = ql.from_ggml(raw, t, (N, K))
            ref_w = gq.dequantize(raw, t, (N, K))
            assert torch.equal(w.dequantize(), ref_w)
        x = torch.randn(M, K, generator=g)
        y = ql.group_gemm(x.to(dev), w.to(dev), torch.float32)
        err = rel_err(y.cpu(), x @ ref_w.T)
        assert err < tol(dev), f"{fmt} M={M} N={N} K={K}: {err:.2e}"
        bias = torch.randn(N, generator=g)  # (added in the launch, or after cuBLAS's product)
        y = ql.group_gemm(x.to(dev), w.to(dev), torch.float32, bias.to(dev))
        assert rel_err(y.cpu(), x @ ref_w.T + bias) < tol(dev), f"{fmt} M={M} N={N} K={K} with a bias"
    with pytest.raises(ValueError, match=r"x must be \[M, 1024\]"):
        ql.group_gemm(torch.randn(2, 512, device=dev), w.to(dev))


@pytest.mark.parametrize("M,N,K", [(1, 200, 1024), (5, 72, 4096), (16, 130, 2048), (40, 64, 4096)])
def test_group_gemm_split_reduce(dev, M, N, K, monkeypatch):
    """Decode-sized GEMMs split K and add the splits in the launch: the plan takes that path here,
    the result matches the reference, repeats bit for bit, and leaves every tile counter at 0."""
    from ktransformers.kernels.triton import common
    from ktransformers.kernels.triton import quant_linear as ql
    g = gen(M * N + K + 1)
    raw = gq.random_blocks(gq.ggml_type("Q4_K"), N * K // 256, g)
    w = ql.from_ggml(raw, gq.ggml_type("Q4_K"), (N, K)).to(dev)
    x = torch.randn(M, K, generator=g)
    plans, plan_split_k = [], ql.plan_split_k  # the plans the GEMM (or the one-row GEMV) takes
    monkeypatch.setattr(ql, "plan_split_k", lambda *a, **k: plans.append(plan_split_k(*a, **k)) or plans[-1])
    ys = [ql.group_gemm(x.to(dev), w, out) for out in (torch.float32, torch.float32, torch.bfloat16)]
    assert len(plans) == 3 and all(p.partials is not None and p.grid[2] > 1 for p in plans), plans[0].grid
    assert torch.equal(ys[0], ys[1])
    assert ys[2].dtype == torch.bfloat16 and torch.equal(ys[2], ys[0].to(torch.bfloat16))
    ref = x @ gq.dequantize(raw, gq.ggml_type("Q4_K"), (N, K)).T
    assert rel_err(ys[0].cpu(), ref) < tol(dev)
    assert int(common.split_counters(x.to(dev).device).abs().sum()) == 0


def test_split_without_counters_uses_atomics(dev, monkeypatch):
    """Where the tile counters cannot be made (a CUDA graph capture before any launch outside
    one), split-K launches fall back to float32 atomics into a zeroed buffer, then a cast: the
    values of the torch product as the serial reduction has them, for the int4 GEMM and the dense
    GEMV alike."""
    from ktransformers.kernels.triton import common
    from ktransformers.kernels.triton import quant_linear as ql
    g = gen(77)
    N, K = 16, 4096
    raw = gq.random_blocks(gq.ggml_type("Q4_K"), N * K // 256, g)
    wq = ql.from_ggml(raw, gq.ggml_type("Q4_K"), (N, K)).to(dev)
    wd, x = torch.randn(N, K, generator=g).to(dev), torch.randn(1, K, generator=g).to(dev)
    x64 = x.cpu().double()
    want = (x64 @ gq.dequantize(raw, gq.ggml_type("Q4_K"), (N, K)).double().T, x64 @ wd.cpu().double().T)
    reduced = (ql.group_gemm(x, wq, torch.bfloat16), ql.dense_gemv(x, wd, torch.bfloat16))
    monkeypatch.setattr(common, "split_counters", lambda device: None)
    plan = ql.gemv_plan(x, N, torch.bfloat16)[3]
    assert plan.atomic and plan.grid[2] > 1
    atomic = (ql.group_gemm(x, wq, torch.bfloat16), ql.dense_gemv(x, wd, torch.bfloat16))
    for a, r, ref in zip(atomic, reduced, want):
        assert a.dtype == torch.bfloat16 and rel_err(a.float().cpu(), ref) < 1e-2
        assert rel_err(r.float().cpu(), ref) < 1e-2


@pytest.mark.parametrize("T,H,K,xdt,idt,wdt", [(1, 2048, 8, torch.bfloat16, torch.int64, torch.bfloat16),
                                                (3, 300, 6, torch.float32, torch.int32, torch.float32),
                                                (5, 7168, 8, torch.float16, torch.int64, torch.bfloat16)])
def test_pack_moe_inputs(dev, T, H, K, xdt, idt, wdt):
    """The hand-off's one-launch packing equals the copies it replaces (exact: conversions only),
    from row-strided inputs; bad outputs are refused by name."""
    from ktransformers.kernels.triton.handoff import pack_moe_inputs, pack_moe_inputs_reference
    g = gen(T * H + K)
    x = torch.randn(T, H + 16, generator=g).to(xdt)[:, :H]  # strided rows
    ids = torch.randint(0, 256, (T, K), generator=g).to(idt)
    w = torch.rand(T, K, generator=g).to(wdt)
    out_x = torch.float32 if xdt != torch.bfloat16 else torch.bfloat16
    got = (torch.empty(T, H, dtype=out_x, device=dev), torch.empty(T, K, dtype=torch.int64, device=dev),
           torch.empty(T, K, dtype=torch.float32, device=dev))
    want = tuple(torch.full_like(t, -7) for t in got)
    pack_moe_inputs(x.to(dev), ids.to(dev), w.to(dev), *got)
    pack_moe_inputs_reference(x.to(dev), ids.to(dev), w.to(dev), *want)
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b.cpu())
    with pytest.raises(ValueError, match="outputs must be"):
        pack_moe_inputs(x.to(dev), ids.to(dev), w.to(dev), got[0], got[1].int(), got[2])
    # cpu_k: the columns from there on go to the CPU as -1 (pairs it skips), the rest unchanged
    cpu_k = K - 2
    pack_moe_inputs(x.to(dev), ids.to(dev), w.to(dev), *got, cpu_k=cpu_k)
    assert torch.equal(got[1][:, :cpu_k].cpu(), ids[:, :cpu_k].long()) and (got[1][:, cpu_k:] == -1).all()
    assert torch.equal(got[0].cpu(), want[0].cpu()) and torch.equal(got[2].cpu(), want[2].cpu())
    with pytest.raises(ValueError, match="cpu_k must lie"):
        pack_moe_inputs(x.to(dev), ids.to(dev), w.to(dev), *got, cpu_k=K + 1)


@pytest.mark.parametrize("T,H,src,dst", [(1, 2048, torch.bfloat16, torch.bfloat16), (3, 7168, torch.float32, torch.bfloat16),
                                         (2, 300, torch.bfloat16, torch.float32)])
def test_copy_rows(dev, T, H, src, dst):
    """The hand-off's read-back kernel equals torch's copy and cast (round to nearest even)."""
    from ktransformers.kernels.triton.handoff import copy_rows
    x = (torch.randn(T, H, generator=gen(T + H)) * 100).to(src)
    out = torch.full((T, H), -3.0, dtype=dst, device=dev)
    copy_rows(x.to(dev), out)
    assert torch.equal(out.cpu(), x.to(dst))
    with pytest.raises(ValueError, match="one \\[T, H\\] shape"):
        copy_rows(x.to(dev), out[:, :-1])
    add = torch.randn(T, H, generator=gen(T * H)) * 10  # the GPU's share of the experts
    copy_rows(x.to(dev), out, add=add.to(dev))
    assert torch.equal(out.cpu(), (x.float() + add).to(dst))  # one rounding, of the float32 sum
    with pytest.raises(ValueError, match="add must be"):
        copy_rows(x.to(dev), out, add=add.to(dev, torch.bfloat16))


@pytest.mark.parametrize("T,H,src,dst,wdt", [(1, 2048, torch.bfloat16, torch.bfloat16, torch.bfloat16),
                                             (3, 7168, torch.float32, torch.bfloat16, torch.float32),
                                             (2, 300, torch.bfloat16, torch.float32, torch.float32)])
def test_copy_rows_add_norm(dev, T, H, src, dst, wdt):
    """The read-back fused with the layer's last residual add and the next input norm, against
    torch: the read-back rounded once to dst, the sum as torch's add rounds it, the norm as
    rms_norm_reference of that sum (bf16: the same bits; float32: within a rounding), with and
    without the GPU's share added."""
    from ktransformers.kernels.triton.handoff import copy_rows_add_norm
    from ktransformers.kernels.triton.norm_rope import rms_norm_reference
    g = gen(T * H + 5)
    x = (torch.randn(T, H, generator=g) * 4).to(src).to(dev)
    residual = (torch.randn(T, H, generator=g) * 8).to(dst).to(dev)
    w = (torch.randn(H, generator=g) * 0.3 + 1).to(wdt).to(dev)
    add = (torch.randn(T, H, generator=g) * 2).to(dev)
    for extra in (None, add):
        y, s, n = copy_rows_add_norm(x, residual, w, 1e-6, dst, add=extra)
        y_ref = (x.float() + (0 if extra is None else extra)).to(dst)
        s_ref = residual + y_ref
        n_ref = rms_norm_reference(s_ref, w, 1e-6)
        assert y.dtype == dst and torch.equal(y, y_ref)
        for got, ref, what in ((s, s_ref, "sum"), (n, n_ref, "norm")):
            assert got.dtype == ref.dtype and got.shape == ref.shape, what
            if ref.dtype == torch.float32:  # (another order of summing x^2)
                assert rel_err(got.cpu(), ref.cpu()) < 1e-6, what
            else:
                assert torch.equal(got, ref), f"{what}: {(got != ref).sum().item()} of {ref.numel()} differ"
    with pytest.raises(ValueError, match="one \\[T, H\\] shape"):
        copy_rows_add_norm(x, residual[:, :-1], w, 1e-6, dst)
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        copy_rows_add_norm(x, residual, w[:-1], 1e-6, dst)
    with pytest.raises(ValueError, match="add must be"):
        copy_rows_add_norm(x, residual, w, 1e-6, dst, add=add.to(torch.bfloat16))


@pytest.mark.parametrize("M,N,K", [(1, 128, 2048), (3, 40, 96), (4, 257, 512), (1, 16, 4096), (2, 24, 3000)])
def test_dense_gemv(dev, M, N, K):
    """The routers' GEMV: bf16 or float32 x against a float32 W, float32 sums (+ a float32 bias),
    any output dtype (the last two shapes split K under the interpreter's 4 SMs; large N does on an H200), and the
    split's tile counters are back at 0 after."""
    from ktransformers.kernels.triton import common
    from ktransformers.kernels.triton import quant_linear as ql
    g = gen(M + N + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    ref = x.double() @ w.double().T
    y = ql.dense_gemv(x.to(dev), w.to(dev)).cpu()
    assert y.dtype == torch.float32 and rel_err(y, ref) < 1e-5
    xb = x.to(torch.bfloat16)
    yb = ql.dense_gemv(xb.to(dev), w.to(dev), torch.bfloat16).cpu()
    assert yb.dtype == torch.bfloat16
    assert rel_err(yb, xb.double() @ w.double().T) < 1e-2
    bias = torch.randn(N, generator=g)  # (gpt-oss's router, biased dense linears) added before the rounding
    yb_bias = ql.dense_gemv(x.to(dev), w.to(dev), torch.float32, bias.to(dev)).cpu()
    assert rel_err(yb_bias, ref + bias.double()) < 1e-5
    assert torch.equal(ql.dense_gemv(x.to(dev), w.to(dev), torch.bfloat16, bias.to(dev)).cpu(),
                       yb_bias.to(torch.bfloat16))
    with pytest.raises(ValueError, match=f"bias must be float32 \\[{N}\\]"):
        ql.dense_gemv(x.to(dev), w.to(dev), torch.float32, bias[1:].to(dev))
    with pytest.raises(ValueError, match="at most 4 rows"):
        ql.dense_gemv(torch.randn(5, K, device=dev), w.to(dev))
    with pytest.raises(ValueError, match="row-major"):  # the right shape, the wrong layout
        ql.dense_gemv(x.to(dev), w.T.contiguous().to(dev).T)
    splits = ql.gemv_plan(x.to(dev), N, torch.float32)[3].grid[2]
    if dev == "cpu" and K >= 3000:
        assert splits > 1  # (the case this parametrization is for)
    if splits > 1:
        assert int(common.split_counters(torch.device(dev)).abs().sum()) == 0
    assert ql.dense_gemv(x[:, :0].to(dev), w[:, :0].contiguous().to(dev)).abs().sum() == 0  # K = 0: zeros


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "Q8_0", "MXFP4"])
def test_dequantize_kernel(dev, fmt, monkeypatch):
    """Layer-wise prefill's GGML -> bf16 decode on the GPU: bit-identical to gguf-py's numpy
    dequantization (rounded once to the output dtype), wrong sizes rejected. Only the types with
    a kernel (KERNEL_TYPES): the others fall back to the torch reference, checked against gguf-py
    in test_ggml_quants."""
    from ktransformers.kernels.triton import dequant as D
    t = gq.ggml_type(fmt)
    assert t in D.KERNEL_TYPES
    per = gq.FORMATS[t].block_elems

    def no_fallback(*args, **kwargs):
        raise AssertionError("dequantize fell back to the torch reference: the kernel did not run")
    for shape in ((3, 512), (7, 2, 768)):
        raw = gq.random_blocks(t, shape[0] * shape[1] * (shape[2] if len(shape) > 2 else 1) // per,
                               gen(sum(shape))).reshape(-1)
        if t == gq.GGMLType.MXFP4:  # every shared exponent, the subnormal scales (0, 1) and 255 included
            blocks = raw.view(-1, gq.FORMATS[t].block_bytes)
            blocks[:, 0] = torch.arange(blocks.shape[0]) % 256
        for dtype in (torch.bfloat16, torch.float32):
            with monkeypatch.context() as m:
                m.setattr(D, "dequantize_reference", no_fallback)
                out = D.dequantize(raw.to(dev), t, shape, dtype)
            ref = gguf_dequantize(raw, t, shape, dtype)
            assert out.dtype == dtype and out.shape == ref.shape
            out = out.cpu()
            if dev != "cuda" and dtype == torch.bfloat16:
                # the interpreter's float32 -> bf16 store flushes subnormals (2^-128 scales); the GPU's
                # rounds them: compare those where it runs, the float32 values (exact) here
                sub = (ref != 0) & (ref.float().abs() < torch.finfo(torch.float32).tiny)
                out, ref = out[~sub], ref[~sub]
            assert torch.equal(out, ref), f"{fmt} {shape} {dtype}"
    with pytest.raises(ValueError, match="expected"):
        D.dequantize(raw[:-1].to(dev), t, shape)
    # into views: gate and up side by side in one [E, 2I, H] tensor, as layer-wise prefill lays them out
    E, I, H = 3, 2, 512
    parts = [gq.random_blocks(t, E * I * H // per, gen(7 + k)).reshape(-1) for k in range(2)]
    both = torch.full((E, 2 * I, H), float("nan"), dtype=torch.bfloat16, device=dev)
    with monkeypatch.context() as m:
        m.setattr(D, "dequantize_reference", no_fallback)
        D.dequantize(parts[0].to(dev), t, (E, I, H), out=both[:, :I])
        D.dequantize(parts[1].to(dev), t, (E, I, H), out=both[:, I:])
    ref = torch.cat([gguf_dequantize(p, t, (E, I, H), torch.bfloat16) for p in parts], 1)
    assert torch.equal(both.cpu(), ref)
    with pytest.raises(ValueError, match="contiguous below its first dim"):
        D.dequantize(parts[0].to(dev), t, (E, I, H), out=torch.empty(E, H, I, dtype=torch.bfloat16, device=dev).transpose(1, 2))


@pytest.mark.parametrize("M", [1, 20, 130])
def test_fp8_gemm(dev, M, monkeypatch):
    """The FP8 GEMM against its dequantized reference; few rows split K (the first shape, on the
    GPU and the interpreter's 4 SMs) and add the splits in the launch: the bf16 output is the
    float32 one rounded, the counters are back at 0, and without counters the atomic fallback
    gives the same values."""
    from ktransformers.kernels.triton import common, fp8
    for N, K in ((256, 512), (200, 300)):
        g = gen(M + N)
        dense = torch.randn(N, K, generator=g)
        w = fp8.quantize_fp8(dense).to(dev)
        assert rel_err(w.dequantize().cpu(), dense) < 0.05
        x = torch.randn(M, K, generator=g).to(dev)
        y = fp8.fp8_gemm(x, w, torch.float32)
        assert rel_err(y.cpu(), x.cpu() @ w.dequantize().cpu().T) < tol(dev)
        if M <= 16 and N == 256:
            assert common.plan_split_k(x, N, K, 16, 64, 128, torch.float32).reduce
        assert torch.equal(fp8.fp8_gemm(x, w, torch.bfloat16), y.to(torch.bfloat16))
        assert int(common.split_counters(x.device).abs().sum()) == 0
        with monkeypatch.context() as m:
            m.setattr(common, "split_counters", lambda device: None)
            assert rel_err(fp8.fp8_gemm(x, w, torch.float32).cpu(), y.cpu()) < 1e-6


def _histories(lens, S, seed):
    perm = torch.randperm(S, generator=gen(seed))
    out, o = [], 0
    for L in lens:
        out.append(perm[o:o + L].to(torch.int32))
        o += L
    return out


@pytest.mark.parametrize("heads,kv_heads,dim,lens,window", [
    (8, 2, 64, [5, 70], 0), (4, 4, 32, [1, 33, 200], 0), (6, 2, 128, [130], 40), (16, 1, 64, [300, 2], 0),
    (8, 2, 64, [300, 90], 200)])
def test_decode_attention_gqa(dev, heads, kv_heads, dim, lens, window, monkeypatch):
    from ktransformers.kernels.triton import attention as A
    monkeypatch.setattr(A, "_merge_splits_kernel", None)  # GQA's rows merge in the decode launch
    S, g = 600, gen(sum(lens))
    k, v = torch.randn(S, kv_heads, dim, generator=g), torch.randn(S, kv_heads, dim, generator=g)
    read = _histories(lens, S, 1)
    q = torch.randn(len(lens), heads, dim, generator=g)
    slots, n = pad_slots(read, dev)
    out = A.decode_attention(q.to(dev), k.to(dev), v.to(dev), slots, n, dim ** -0.5, window=window).cpu()
    # the output dtype rounds the same float32 result once (one split or a merge of several)
    out_bf16 = A.decode_attention(q.to(dev), k.to(dev), v.to(dev), slots, n, dim ** -0.5, window=window,
                                  out_dtype=torch.bfloat16).cpu()
    assert out.dtype == torch.float32 and out_bf16.dtype == torch.bfloat16
    assert torch.equal(out_bf16, out.to(torch.bfloat16))
    for b, idx in enumerate(read):
        ref = A.attention_reference(q[b:b + 1], k[idx.long()], v[idx.long()], len(idx) - 1, dim ** -0.5, window=window)
        assert rel_err(out[b], ref[0]) < tol(dev), f"sequence {b}"
    # gpt-oss's per-head sinks: a softmax column without a value (in split 0 of several, or the one);
    # centred near the log of a history's summed weights, so that they move every sequence's result
    sinks = 2 * torch.randn(heads, generator=g) + 4
    out = A.decode_attention(q.to(dev), k.to(dev), v.to(dev), slots, n, dim ** -0.5, window=window,
                             sinks=sinks.to(dev)).cpu()
    for b, idx in enumerate(read):
        ref = A.attention_reference(q[b:b + 1], k[idx.long()], v[idx.long()], len(idx) - 1, dim ** -0.5, window=window,
                                    sinks=sinks)
        plain = A.attention_reference(q[b:b + 1], k[idx.long()], v[idx.long()], len(idx) - 1, dim ** -0.5,
                                      window=window)
        err = rel_err(out[b], ref[0])
        assert err < tol(dev), f"sequence {b} with sinks"
        assert rel_err(ref, plain) > max(10 * err, 1e-2), f"sequence {b}: the sinks hardly changed the result"
    with pytest.raises(ValueError, match="sinks must be"):
        A.decode_attention(q.to(dev), k.to(dev), v.to(dev), slots, n, 0.1, sinks=sinks[1:].to(dev))
    # the splits were merged in the launch (the last split of a head block), counters back at 0
    from ktransformers.kernels.triton.common import split_counters
    assert int(split_counters(torch.device(dev)).abs().sum()) == 0


@pytest.mark.parametrize("heads,rank,rope,lens", [(5, 48, 16, [7, 150]), (16, 512, 64, [1, 40, 333])])
def test_decode_attention_mla_latent(dev, heads, rank, rope, lens):
    """MLA decode in latent space over the [slots, r + p] cache: k1 = c, k2 = k_rot, v = c."""
    from ktransformers.kernels.triton import attention as A
    S, g = 800, gen(rank)
    cache = torch.randn(S, rank + rope, generator=g)
    read = _histories(lens, S, 2)
    q_lat, q_rot = torch.randn(len(lens), heads, rank, generator=g), torch.randn(len(lens), heads, rope, generator=g)
    slots, n = pad_slots(read, dev)
    c = cache.to(dev)
    out = A.decode_attention(q_lat.to(dev), c[:, None, :rank], None, slots, n, 0.1, q2=q_rot.to(dev),
                             k2=c[:, None, rank:]).cpu()
    for b, idx in enumerate(read):
        hist = cache[idx.long()]
        ref = A.attention_reference(q_lat[b:b + 1], hist[:, None, :rank], hist[:, None, :rank], len(idx) - 1, 0.1,
                                    q2=q_rot[b:b + 1], k2=hist[:, None, rank:])
        assert rel_err(out[b], ref[0]) < tol(dev)


@pytest.mark.parametrize("tq,start,heads,kv_heads,dim,window", [
    (40, 0, 4, 2, 32, 0), (17, 50, 6, 3, 64, 0), (70, 10, 2, 1, 16, 25), (130, 0, 4, 4, 128, 0)])
def test_prefill_attention(dev, tq, start, heads, kv_heads, dim, window):
    from ktransformers.kernels.triton import attention as A
    L, g = start + tq, gen(tq + start)
    k, v = torch.randn(L, kv_heads, dim, generator=g), torch.randn(L, kv_heads, dim, generator=g)
    q = torch.randn(tq, heads, dim, generator=g)
    ref = A.attention_reference(q, k, v, start, 0.2, window=window)
    out = A.prefill_attention(q.to(dev), k.to(dev), v.to(dev), start, 0.2, window=window).cpu()
    assert rel_err(out, ref) < tol(dev)
    # the same history scattered over cache slots, read in place
    S = 3 * L
    slots = torch.randperm(S, generator=g)[:L]
    kc, vc = torch.randn(S, kv_heads, dim, generator=g), torch.randn(S, kv_heads, dim, generator=g)
    kc[slots], vc[slots] = k, v
    out = A.prefill_attention(q.to(dev), kc.to(dev), vc.to(dev), start, 0.2, window=window,
                              slots=slots.to(torch.int32).to(dev)).cpu()
    assert rel_err(out, ref) < tol(dev)
    sinks = 2 * torch.randn(heads, generator=g)
    ref = A.attention_reference(q, k, v, start, 0.2, window=window, sinks=sinks)
    out = A.prefill_attention(q.to(dev), kc.to(dev), vc.to(dev), start, 0.2, window=window,
                              slots=slots.to(torch.int32).to(dev), sinks=sinks.to(dev)).cpu()
    assert rel_err(out, ref) < tol(dev)


def test_prefill_attention_mla_expanded(dev):
    """MLA prefill: per-head k_nope and v, one rotated key shared by every head (head stride 0)."""
    from ktransformers.kernels.triton import attention as A
    for tq, start, h, n, p, dv in ((20, 9, 3, 32, 16, 24), (64, 0, 4, 128, 64, 128)):
        L, g = start + tq, gen(tq)
        kn, kr, v = (torch.randn(L, h, n, generator=g), torch.randn(L, 1, p, generator=g),
                     torch.randn(L, h, dv, generator=g))
        qn, qr = torch.randn(tq, h, n, generator=g), torch.randn(tq, h, p, generator=g)
        out = A.prefill_attention(qn.to(dev), kn.to(dev), v.to(dev), start, 0.3, q2=qr.to(dev), k2=kr.to(dev)).cpu()
        assert rel_err(out, A.attention_reference(qn, kn, v, start, 0.3, q2=qr, k2=kr)) < tol(dev)


@pytest.mark.parametrize("fmt", ["bf16", "Q4_0", "Q4_K", "Q8_0", "MXFP4"])
@pytest.mark.parametrize("T,E,K", [(1, 8, 2), (3, 7, 3), (17, 5, 2), (64, 9, 4)])
def test_fused_moe(dev, fmt, T, E, K):
    from ktransformers.kernels.triton import fused_moe as fm
    H, I = 256, 256
    g = gen(T * E + K)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    if fmt == "bf16":
        gu = (0.05 * torch.randn(E, 2 * I, H, generator=g)).bfloat16()
        dn = (0.05 * torch.randn(E, H, I, generator=g)).bfloat16()
        gu_ref, dn_ref, gu_w, dn_w = gu.float(), dn.float(), gu.to(dev), dn.to(dev)
    else:
        t = gq.ggml_type(fmt)
        per = gq.FORMATS[t].block_elems
        raws = [gq.random_blocks(t, E * I * H // per, g) for _ in range(3)]
        gu_w = fm.stack_group_weights([(raws[0], t, (E, I, H)), (raws[1], t, (E, I, H))]).to(dev)
        dn_w = fm.stack_group_weights([(raws[2], t, (E, H, I))]).to(dev)
        gu_ref = torch.cat([gq.dequantize(raws[0], t, (E, I, H)), gq.dequantize(raws[1], t, (E, I, H))], 1)
        dn_ref = gq.dequantize(raws[2], t, (E, H, I))
        assert torch.equal(gu_w.dequantize().cpu(), gu_ref)
    ref = moe_reference(x, ids, w, gu_ref, dn_ref)
    y = fm.fused_moe(x.to(dev), ids.to(dev), w.to(dev), gu_w, dn_w).cpu()
    assert rel_err(y, ref) < tol(dev), fmt
    # pairs marked -1 (experts held elsewhere) contribute nothing
    skip = (ids % 2 == 1) & (torch.arange(T)[:, None] % 3 != 0)
    y = fm.fused_moe(x.to(dev), ids.masked_fill(skip, -1).to(dev), w.to(dev), gu_w, dn_w).cpu()
    ref = moe_reference(x, ids, w.masked_fill(skip, 0), gu_ref, dn_ref)
    assert rel_err(y, ref) < tol(dev)


@pytest.mark.parametrize("fmt", ["bf16", "MXFP4"])
@pytest.mark.parametrize("T,E,K", [(1, 8, 2), (9, 6, 4), (70, 5, 2)])
def test_fused_moe_with_biases_and_clamped_swiglu(dev, fmt, T, E, K):
    """gpt-oss's experts: biases on gate, up and down, the clamped SwiGLU (limit 7, alpha 1.702),
    MXFP4 weights; against the torch formula on the same (dequantized) weights."""
    from ktransformers.kernels.triton import fused_moe as fm
    from ktransformers.operators.experts.reference import Activation
    H, I = 128, 96
    g = gen(T * E + 3 * K)
    x = 4 * torch.randn(T, H, generator=g)  # (large enough that the clamps bite)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    bias = (torch.randn(E, 2 * I, generator=g), 0.1 * torch.randn(E, H, generator=g))
    if fmt == "bf16":
        gu = (0.1 * torch.randn(E, 2 * I, H, generator=g)).bfloat16()
        dn = (0.05 * torch.randn(E, H, I, generator=g)).bfloat16()
        gu_ref, dn_ref, gu_w, dn_w = gu.float(), dn.float(), gu.to(dev), dn.to(dev)
    else:
        t = gq.GGMLType.MXFP4
        raws = [gq.random_blocks(t, E * I * H // 32, g) for _ in range(3)]
        for r in raws:  # scales of 2^-5..2^-2: gate/up outputs of a few units, past the limit at times
            r.view(-1, 17)[:, 0] = torch.randint(123, 127, (r.numel() // 17,), dtype=torch.uint8, generator=g)
        gu_w = fm.stack_group_weights([(raws[0], t, (E, I, H)), (raws[1], t, (E, I, H))]).to(dev)
        dn_w = fm.stack_group_weights([(raws[2], t, (E, H, I))]).to(dev)
        gu_ref = torch.cat([gq.dequantize(raws[0], t, (E, I, H)), gq.dequantize(raws[1], t, (E, I, H))], 1)
        dn_ref = gq.dequantize(raws[2], t, (E, H, I))
    act = Activation(limit=7.0, alpha=1.702)
    ref = moe_reference(x, ids, w, gu_ref, dn_ref, act=act, bias=bias)
    pre = torch.einsum("th,eih->tei", x, gu_ref) + bias[0]
    assert (pre.abs() > 7).float().mean() > 0.02  # some gate/up values are clamped
    y = fm.fused_moe(x.to(dev), ids.to(dev), w.to(dev), gu_w, dn_w, bias=tuple(b.to(dev) for b in bias), act=act).cpu()
    assert rel_err(y, ref) < tol(dev), fmt
    assert rel_err(moe_reference(x, ids, w, gu_ref, dn_ref), ref) > 10 * tol(dev)  # (the biases and clamp matter)
    with pytest.raises(ValueError, match="gate_up bias must be"):
        fm.fused_moe(x.to(dev), ids.to(dev), w.to(dev), gu_w, dn_w, bias=(bias[0][1:].to(dev), bias[1].to(dev)))


@pytest.mark.parametrize("T,E,K,groups", [(1, 8, 2, [(0, 3), (3, 8)]), (17, 7, 3, [(0, 2), (2, 4), (4, 7)]),
                                           (70, 5, 2, [(0, 1), (1, 5)])])
def test_fused_moe_in_expert_groups_equals_one_call(dev, T, E, K, groups):
    """Layer-wise prefill of a large layer: the experts in groups, each call with the others' ids
    as -1 writing its pairs' rows into one buffer, summed once: the bits of one call over all of
    them (block_m of all the experts), whichever group a token's experts fall in."""
    from ktransformers.kernels.triton import fused_moe as fm
    H, I = 128, 192
    g = gen(T + E * K)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    gu = (0.05 * torch.randn(E, 2 * I, H, generator=g)).bfloat16()
    dn = (0.05 * torch.randn(E, H, I, generator=g)).bfloat16()
    x, ids, w, gu, dn = x.to(dev), ids.to(dev), w.to(dev), gu.to(dev), dn.to(dev)
    whole = fm.fused_moe(x, ids, w, gu, dn)
    pairs = torch.zeros(T * K, H, device=dev)
    block_m = fm.fused_moe_block_m(T, K, E)
    for e0, e1 in groups:
        local = torch.where((ids >= e0) & (ids < e1), ids - e0, -1)
        assert fm.fused_moe(x, local, w, gu[e0:e1], dn[e0:e1], pairs=pairs, block_m=block_m) is pairs
    assert torch.equal(pairs.view(T, K, H).sum(1), whole)
    ref = moe_reference(x.cpu().float(), ids.cpu(), w.cpu(), gu.cpu().float(), dn.cpu().float())
    assert rel_err(whole.cpu(), ref) < tol(dev)
    with pytest.raises(ValueError, match="pairs must be"):
        fm.fused_moe(x, ids, w, gu, dn, pairs=torch.zeros(T * K, H + 1, device=dev))
    with pytest.raises(ValueError, match="block_m must be"):
        fm.fused_moe(x, ids, w, gu, dn, pairs=pairs, block_m=32)


def test_dequantize_for_cublas(dev):
    """The many-row path's one-pass dequantization (int4/int8 and FP8) to bf16 Wᵀ."""
    from ktransformers.kernels.triton import fp8
    from ktransformers.kernels.triton import quant_linear as ql
    g = gen(11)
    for t in ("Q4_K", "Q8_0", "Q6_K"):
        raw = gq.random_blocks(t, 96 * 512 // gq.FORMATS[gq.ggml_type(t)].block_elems, g)
        w = ql.from_ggml(raw, gq.ggml_type(t), (96, 512))
        got = ql.dequantize_t(w.to(dev)).cpu().float()
        ref = gq.dequantize(raw, t, (96, 512)).T
        # one bf16 step apart at most (the interpreter truncates to bf16 where the GPU rounds)
        assert torch.allclose(got, ref, rtol=2 ** -7, atol=0), t
    w = fp8.quantize_fp8(torch.randn(200, 300, generator=g))
    assert torch.allclose(fp8.dequantize_t(w.to(dev)).cpu().float(), w.dequantize().T, rtol=2 ** -7, atol=0)


def test_align_is_sync_free_and_complete(dev):
    """Every live pair lands once in its expert's padded run; dropped (-1) pairs nowhere."""
    from ktransformers.kernels.triton.fused_moe import align
    g = gen(12)
    for T, E, K, bm in ((1, 8, 2, 16), (37, 6, 3, 16), (100, 9, 4, 64)):
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        ids[torch.rand(T, K, generator=g) < 0.2] = -1
        pairs, block_expert = align(ids.to(dev), E, bm)
        pairs, block_expert = pairs.cpu().long(), block_expert.cpu().long()
        flat = ids.reshape(-1)
        live = pairs[pairs < T * K]
        assert sorted(live.tolist()) == torch.nonzero(flat >= 0).flatten().tolist()
        expert_of_row = block_expert.repeat_interleave(bm)[: len(pairs)]
        assert torch.equal(flat[live], expert_of_row[pairs < T * K])
        assert (block_expert <= E).all()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("N,K", [(96, 256), (200, 1024), (72, 160), (64, 4096), (136, 288)])
def test_quant_gemv_one_row(dev, bits, N, K, monkeypatch):
    """One row on int4 or int8 weights takes the float32 GEMV without tl.dot (every block size it
    picks: int4's K % 256, % 128 and % 32, in 64 or 128 columns; int8's 256 with the last block
    past K), split or not,
    and matches the dequantized reference closely; with a bias (gpt-oss's and GLM's projections)
    added in the launch before the one rounding."""
    from ktransformers.kernels.triton import quant_linear as ql
    g = gen(N + K + bits)
    dense = torch.randn(N, K, generator=g)
    w = (ql.quantize_int4 if bits == 4 else ql.quantize_int8)(dense).to(dev)
    # the packed codes hold the weight (within its rounding): the reference is not the kernel's layout alone
    step = (dense.reshape(N, K // 32, 32).amax(-1) - dense.reshape(N, K // 32, 32).amin(-1)) / 15 if bits == 4 \
        else dense.reshape(N, K // 32, 32).abs().amax(-1) / 127
    assert ((w.dequantize().cpu() - dense).abs().reshape(N, K // 32, 32) <= step[..., None] * 0.5001 + 1e-6).all()
    x = torch.randn(1, K, generator=g)
    calls, real = [], ql._quant_gemv
    monkeypatch.setattr(ql, "_quant_gemv", lambda *a: calls.append(a) or real(*a))
    y = ql.group_gemm(x.to(dev), w, torch.float32)
    assert len(calls) == 1
    ref = x.double() @ w.dequantize().cpu().double().T
    assert rel_err(y.cpu().double(), ref) < 1e-5
    bias = torch.randn(N, generator=g)
    y = ql.group_gemm(x.to(dev), w, torch.float32, bias.to(dev))
    assert len(calls) == 2 and rel_err(y.cpu().double(), ref + bias.double()) < 1e-5
    assert torch.equal(ql.group_gemm(x.to(dev), w, torch.bfloat16, bias.to(dev)), y.to(torch.bfloat16))
    with pytest.raises(ValueError, match=f"bias must be float32 \\[{N}\\]"):
        ql.group_gemm(x.to(dev), w, torch.float32, bias[1:].to(dev))
    if bits == 4:  # a large weight's wider programs (GLM's q and o), at this size
        monkeypatch.setattr(ql, "GEMV_WIDE", 0)
        assert ql._gemv_blocks(4, N, K)[0] == 128
        y = ql.group_gemm(x.to(dev), w, torch.float32, bias.to(dev))
        assert len(calls) == 4 and rel_err(y.cpu().double(), ref + bias.double()) < 1e-5


GEMV_MANY_SHAPES = [((256, 512), (64, 512), (64, 512)), ((200, 1024), (72, 1024)), ((96, 160), (40, 160), (8, 160)),
                    ((128, 256), (64, 256))]


# (a Q6_K weight only where K is whole Q6_K blocks)
@pytest.mark.parametrize("shapes,second", [(shapes, second) for shapes in GEMV_MANY_SHAPES
                                           for second in ("int4", "int8", "int4-wide", "Q6_K")
                                           if second != "Q6_K" or shapes[0][1] % 256 == 0])
def test_gemv_many(dev, shapes, second, monkeypatch):
    """q, k and v of one token in one launch: int4, int8 (groups of 32, or Q6_K's 16) and dense
    bf16 weights mixed, with and without biases (added in the launch), K split (the first three)
    or not (one block), each output within float32 summation of its reference (float32 sums
    rounded once), counters back at 0."""
    from ktransformers.kernels.triton import common
    from ktransformers.kernels.triton import quant_linear as ql
    g = gen(sum(n for n, _ in shapes))
    K = shapes[0][1]
    dense = [torch.randn(N, K, generator=g) for N, _ in shapes]
    if second == "int4-wide":  # every int4 weight in the wider programs of a large one (GLM's q)
        monkeypatch.setattr(ql, "GEMV_WIDE", 0)
    quantize = {0: ql.quantize_int4, 1: ql.quantize_int8 if second == "int8" else ql.quantize_int4}
    if second == "Q6_K":  # (a Q6_K attn_v beside Q4_K q and k, as in Q4_K_M files)
        quantize[1] = lambda d: ql.from_ggml(gq.random_blocks("Q6_K", d.numel() // 256, g), gq.ggml_type("Q6_K"),
                                             tuple(d.shape))
    weights = [quantize[i](d).to(dev) if i in quantize else d.to(torch.bfloat16).to(dev) for i, d in enumerate(dense)]
    x = torch.randn(1, K, generator=g).to(torch.bfloat16)
    biases = [torch.randn(N, generator=g).to(dev) if i != 1 else None for i, (N, _) in enumerate(shapes)]
    for with_bias in (False, True):
        bs = biases if with_bias else None
        ys = ql.gemv_many(x.to(dev), weights, torch.float32, bs)
        assert ys is not None and len(ys) == len(shapes)
        for i, (y, w) in enumerate(zip(ys, weights)):
            ref_w = w.dequantize().cpu() if isinstance(w, ql.GroupQuantWeight) else w.float().cpu()
            ref = x.float() @ ref_w.T + (biases[i].cpu() if with_bias and biases[i] is not None else 0)
            assert y.shape == ref.shape and rel_err(y.cpu(), ref) < 1e-5, f"weight {i}, bias {with_bias}"
        bf16 = ql.gemv_many(x.to(dev), weights, torch.bfloat16, bs)
        assert all(torch.equal(b, y.to(torch.bfloat16)) for b, y in zip(bf16, ys))
    assert int(common.split_counters(x.to(dev).device).abs().sum()) == 0
    # what the launch does not take: two rows, int4 codes without offsets, a weight of another K, a bias of
    # another width
    assert ql.gemv_many(torch.randn(2, K).to(dev), weights, torch.float32) is None
    w0 = weights[0]
    no_offset = ql.GroupQuantWeight(4, w0.codes, w0.scale, None, w0.out_features, w0.in_features)
    assert ql.gemv_many(x.to(dev), [weights[0], no_offset], torch.float32) is None
    assert ql.gemv_many(x.to(dev), [weights[0], torch.randn(8, K + 32).to(dev)], torch.float32) is None
    assert ql.gemv_many(x.to(dev), weights, torch.float32, [biases[0][1:]] + biases[1:]) is None


def test_fused_paths_without_counters_fall_back(dev, monkeypatch):
    """Where the tile counters cannot be made (a CUDA graph capture before any launch outside one),
    decode attention merges in a second launch, and gemv_many and router_topk decline (their
    callers run the unfused kernels): the same results either way."""
    from ktransformers.kernels.triton import attention as A
    from ktransformers.kernels.triton import quant_linear as ql
    from ktransformers.kernels.triton import router
    g = gen(31)
    S, kv, d = 300, 2, 64
    k, v = torch.randn(S, kv, d, generator=g).to(dev), torch.randn(S, kv, d, generator=g).to(dev)
    q = torch.randn(2, 8, d, generator=g).to(dev)
    slots, n = pad_slots(_histories([250, 90], S, 3), dev)
    x = torch.randn(1, 512, generator=g).to(dev)
    weights = [ql.quantize_int4(torch.randn(256, 512, generator=g)).to(dev),
               torch.randn(64, 512, generator=g).to(torch.bfloat16).to(dev)]
    gate = torch.randn(60, 512, generator=g).to(dev)
    merged = A.decode_attention(q, k, v, slots, n, d ** -0.5)
    many = ql.gemv_many(x, weights, torch.float32)
    routed = router.router_topk(x, gate, 4, True, torch.float32, torch.float32)
    assert many is not None and routed is not None
    merges, real_merge = [], A._merge_splits_kernel

    class Spy:  # the second launch, recorded
        def __getitem__(self, grid):
            merges.append(grid)
            return real_merge[grid]

    monkeypatch.setattr(A, "_merge_splits_kernel", Spy())
    for module in (A, ql, router):
        monkeypatch.setattr(module, "split_counters", lambda device: None)
    assert rel_err(A.decode_attention(q, k, v, slots, n, d ** -0.5).cpu(), merged.cpu()) < 1e-6 and merges
    assert ql.gemv_many(x, weights, torch.float32) is None
    assert router.router_topk(x, gate, 4, True, torch.float32, torch.float32) is None


def test_pdl_options(monkeypatch):
    """Kernels launch as programmatic dependents only on CUDA devices that have PDL; elsewhere
    their GDC parameter is off (gdc_enter compiles to nothing)."""
    pytest.importorskip("triton", reason="the launch options are Triton's")
    from ktransformers.kernels.triton import pdl as pdl_module
    from ktransformers.kernels.triton.pdl import pdl
    assert pdl(torch.device("cpu")) == {"GDC": False}
    if torch.cuda.is_available():
        on = torch.cuda.get_device_capability()[0] >= 9
        assert pdl(torch.device("cuda")) == ({"GDC": True, "launch_pdl": True} if on else {"GDC": False})
        monkeypatch.setattr(pdl_module, "_has_pdl", lambda index: False)
        assert pdl(torch.device("cuda")) == {"GDC": False}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pdl_chain_in_graph_equals_plain(monkeypatch):
    """A decode layer's chain of launches, each reading what the one before wrote (norm -> q/k/v
    GEMVs -> q/k norm + RoPE with the cache write -> attention over a history long enough to be
    split and merged in the launch -> o GEMV -> residual add + norm -> router -> pack into pinned
    memory), six times over, as programmatic dependent launches: eagerly, and replayed as a CUDA
    graph on a new input each replay, the same bits as the same launches made plainly
    (on a device taken for one without PDL). A kernel that read its input before waiting for the launch that writes it would
    read the previous launch's or the previous replay's values here."""
    from ktransformers.kernels.triton import attention as A
    from ktransformers.kernels.triton import handoff, norm_rope
    from ktransformers.kernels.triton import quant_linear as ql
    from ktransformers.kernels.triton import pdl as pdl_module
    from ktransformers.kernels.triton import router
    from ktransformers.kernels.triton.pdl import pdl
    if not pdl(torch.device("cuda"))["GDC"]:
        pytest.skip("this GPU has no programmatic dependent launch")
    g = gen(77)
    H, heads, kv, d, E, K, S, L = 512, 8, 2, 64, 64, 4, 640, 500
    dev = "cuda"
    wq, wk = (ql.quantize_int4(torch.randn(n * d, H, generator=g) / H ** 0.5).to(dev) for n in (heads, kv))
    wv = (torch.randn(kv * d, H, generator=g) / H ** 0.5).to(torch.bfloat16).to(dev)
    wo = ql.quantize_int4(torch.randn(H, heads * d, generator=g) / (heads * d) ** 0.5).to(dev)
    w_in, w_post, qn, kn = ((1 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16).to(dev) for n in (H, H, d, d))
    gate = torch.randn(E, H, generator=g).to(dev)
    angles = torch.rand(1, 1, d, generator=g) * 6
    cos, sin = angles.cos().to(torch.bfloat16).to(dev), angles.sin().to(torch.bfloat16).to(dev)
    inputs = [torch.randn(1, H, generator=g).to(torch.bfloat16).to(dev) for _ in range(3)]
    caches0 = [torch.randn(S, kv, d, generator=g).to(torch.bfloat16).to(dev) for _ in range(2)]
    slots = torch.randperm(S, generator=g)[:L].to(dev)
    slot_table, lens = slots[None].to(torch.int32), torch.tensor([L], dtype=torch.int32, device=dev)
    step = slots[-1:].long()
    pinned = (torch.empty(1, H, dtype=torch.bfloat16, pin_memory=True), torch.empty(1, K, dtype=torch.int64, pin_memory=True),
              torch.empty(1, K, dtype=torch.float32, pin_memory=True))

    def chain(x, kc, vc):
        outs = []
        for _ in range(6):
            h = norm_rope.rms_norm(x, w_in, 1e-6)
            q, k, v = ql.gemv_many(h, [wq, wk, wv], torch.bfloat16)
            q, k = norm_rope.qk_norm_rope(q.view(1, 1, heads, d), k.view(1, 1, kv, d), cos, sin, qn, kn,
                                          write=(v.view(1, 1, kv, d), kc, vc, step))
            a = A.decode_attention(q.view(1, heads, d), kc, vc, slot_table, lens, d ** -0.5, out_dtype=torch.bfloat16)
            o = ql.group_gemm(a.reshape(1, heads * d), wo, torch.bfloat16)
            x, h2 = norm_rope.add_rms_norm(x, o, w_post, 1e-6)
            _, w, ids = router.router_topk(h2, gate, K, True, torch.float32, torch.float32)
            handoff.pack_moe_inputs(h2, ids, w, *pinned)
            outs += [x, w, ids]
        return outs

    def run(x):  # (outputs, caches, the last pack) of one chain on fresh copies of the caches
        caches = [c.clone() for c in caches0]
        outs = [t.clone() for t in chain(x, *caches)]
        torch.cuda.synchronize()
        return outs + caches + [p.clone() for p in pinned]

    has_pdl = pdl_module._has_pdl
    monkeypatch.setattr(pdl_module, "_has_pdl", lambda index: False)
    want = [run(x) for x in inputs]
    monkeypatch.setattr(pdl_module, "_has_pdl", has_pdl)
    got = run(inputs[0])  # eagerly (and compiled, the counters made, outside the capture)
    assert all(torch.equal(a, b) for a, b in zip(got, want[0]))
    x_in = inputs[0].clone()
    caches = [c.clone() for c in caches0]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        outs = chain(x_in, *caches)
    for _ in range(2):
        for x, ref in zip(inputs, want):
            x_in.copy_(x)
            for c, c0 in zip(caches, caches0):
                c.copy_(c0)
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(outs + caches + list(pinned), ref))



# Run in a process of its own: this one's kernels are the interpreter's (TRITON_INTERPRET=1).
_HOPPER_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ktransformers.kernels.triton import attention, dequant, fused_moe, handoff, norm_rope, pcie_experts, quant_linear, router

def compile_(fn, types, consts):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    assert "cubin" in triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm
    print("compiled", fn.__name__)

ptrs = {"x_ptr": "*bf16", "g_ptr": "*fp32", "b_ptr": "*fp32", "y_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32",
        "w_ptr": "*bf16", "idx_ptr": "*i64", "xo_ptr": "*bf16", "io_ptr": "*i64", "wo_ptr": "*fp32", "cb_ptr": "*fp32",
        "scale": "fp32", "eps": "fp32"}
for pack in (False, True):  # (with the pack: DeepSeek-V3's sigmoid route in groups)
    compile_(router._router_kernel, ptrs, dict(HAS_BIAS=pack, BLOCK_M=1, BLOCK_N=16, BLOCK_H=256, REDUCE=True, K=8,
                                               BLOCK_E=256, BLOCK_K=8, NORM=True, PACK=pack, PACK_BLOCK=1024, GDC=True,
                                               SIGMOID=pack, GROUP_SIZE=32 if pack else 0, TOPK_GROUP=4))
# q/k norms, partial rotary (GLM-4.5's half) and the cache write in one launch
rope = {n: "*bf16" for n in ("q_ptr", "k_ptr", "qw_ptr", "kw_ptr", "qo_ptr", "ko_ptr", "v_ptr", "kc_ptr", "vc_ptr")}
rope.update({"cos_ptr": "*fp32", "sin_ptr": "*fp32", "q_eps": "fp32", "k_eps": "fp32", "slot_ptr": "*i64"})
compile_(norm_rope._qk_norm_rope_kernel, rope, dict(BLOCK_HALF=32, BLOCK_PASS=64, NORM=True, WRITE=True, GDC=True))
compile_(handoff._copy_add_norm_kernel, {"src_ptr": "*bf16", "add_ptr": "*fp32", "r_ptr": "*bf16", "w_ptr": "*bf16",
                                         "y_ptr": "*bf16", "s_ptr": "*bf16", "n_ptr": "*bf16", "eps": "fp32"},
         dict(BLOCK_H=2048, ADD=True))
for t, size in pcie_experts.TILE_BYTES.items():
    compile_(pcie_experts._dequant_tiles_kernel, {"tiles": "*u8", "out": "*bf16", "n_tiles": "i64"},
             dict(TYPE=t, TILE=size, TILES=4))
# gpt-oss's kernels: attention with sinks, the experts' MXFP4 codes, biases and clamped SwiGLU
f32 = {n: "fp32" for n in ("scale", "limit", "alpha")}
att = {n: "*bf16" for n in ("q1_ptr", "q2_ptr", "k1_ptr", "k2_ptr", "v_ptr", "out_ptr")}
att.update(f32, slots_ptr="*i32", lens_ptr="*i32", sinks_ptr="*fp32", acc_ptr="*fp32", lse_ptr="*fp32",
           count_ptr="*i32")
compile_(attention._decode_kernel, att, dict(BLOCK_H=8, BLOCK_T=64, BLOCK_D1=64, BLOCK_D2=16, BLOCK_DV=64,
                                             HAS_K2=False, V_IS_K1=False, HAS_SINKS=True, DOT_F32=False, MERGE=True,
                                             BLOCK_S=8, GDC=False))
compile_(attention._prefill_kernel, att, dict(BLOCK_M=64, BLOCK_T=32, BLOCK_D1=64, BLOCK_D2=16, BLOCK_DV=64,
                                              HAS_K2=False, PAGED=True, HAS_SINKS=True, DOT_F32=False))
moe = dict(f32, a_ptr="*bf16", pairs_ptr="*i32", block_expert_ptr="*i32", w_ptr="*i32", scale_ptr="*fp32",
           offset_ptr="*fp32", bias_ptr="*fp32", route_ptr="*fp32", out_ptr="*bf16")
for gated in (True, False):
    compile_(fused_moe._expert_gemm_kernel, moe, dict(GATED=gated, A_BY_TOKEN=gated, BITS=4, HAS_OFFSET=False,
                                                      E2M1=True, HAS_BIAS=True, CLAMPED=gated, BLOCK_M=16,
                                                      BLOCK_N=64, BLOCK_K=64, GROUP_SIZE=32, DOT_F32=False))
# the layer-wise prefill's dense bf16 experts: the group-quantized branches must not be compiled for them
compile_(fused_moe._expert_gemm_kernel, dict(moe, w_ptr="*bf16"), dict(GATED=True, A_BY_TOKEN=True, BITS=16,
                                                                    HAS_OFFSET=False, E2M1=False, HAS_BIAS=False,
                                                                    CLAMPED=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64,
                                                                    GROUP_SIZE=32, DOT_F32=False))
compile_(dequant._dequant_kernel, {"src_ptr": "*u8", "out_ptr": "*bf16", "n_blocks": "i64"},
         dict(TYPE=39, BLOCK_BYTES=17, BLOCK_ELEMS=32, BLOCKS=8))
# one row: a GEMV with a bias, and q, k and v with biases in one launch
gemv = {"x_ptr": "*bf16", "codes_ptr": "*i32", "scale_ptr": "*fp32", "offset_ptr": "*fp32", "bias_ptr": "*fp32",
        "y_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32"}
for bits, group in ((4, 32), (8, 32), (8, 16)):  # (int8 in groups of 16: Q6_K's)
    compile_(quant_linear._quant_gemv_kernel, gemv, dict(BITS=bits, HAS_OFFSET=bits == 4, HAS_BIAS=True, BLOCK_N=64,
                                                         BLOCK_K=256, GROUP_SIZE=group, ATOMIC=False, REDUCE=True,
                                                         GDC=True))
many = {"x_ptr": "*bf16", "count_ptr": "*i32", "w0": "*i32", "w1": "*i32", "w2": "*bf16", "s2": "*bf16", "o2": "*bf16"}
many.update({f"{n}{i}": "*fp32" for n in ("s", "o", "b", "p") for i in (0, 1, 2) if f"{n}{i}" not in many})
many.update({f"y{i}": "*bf16" for i in (0, 1, 2)})
gemm = dict(gemv, x_ptr="*bf16")
compile_(quant_linear._group_gemm_kernel, gemm, dict(BITS=8, HAS_OFFSET=False, HAS_BIAS=True, GROUP_SIZE=32, BLOCK_M=16,
                                                     BLOCK_N=64, BLOCK_K=128, ATOMIC=False, REDUCE=True, DOT_F32=False))
compile_(quant_linear._gemv_many_kernel, many, dict(BITS_0=4, BITS_1=8, BITS_2=0, BIAS_0=True, BIAS_1=False,
                                                    BIAS_2=True, BN0=64, BN1=128, BN2=32, G0=32, G1=16, G2=32,
                                                    BLOCK_K=256, REDUCE=True, GDC=True))
"""


def test_kernels_compile_for_hopper():
    """The router with and without the pack in passing (softmax; sigmoid in groups), the q/k
    norm and partial RoPE with the cache write, the fused read-back, the tiles'
    dequantization (Q4_K, Q6_K), gpt-oss's kernels (attention with sinks, MXFP4 experts with
    biases and the clamped SwiGLU, MXFP4 dequantization) and the projections' GEMV and GEMM
    with biases compile to an sm_90 cubin here, GPU or not (Triton's compiler and ptxas): type
    errors the interpreter lets through (a loop-carried variable changing type, say) fail here,
    not on the GPU machine."""
    import os
    import subprocess
    import sys
    pytest.importorskip("triton.backends.nvidia.compiler", reason="no NVIDIA backend in this Triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _HOPPER_COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.count("compiled") == 17, done.stderr[-3000:]
