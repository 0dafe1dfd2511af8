"""The decode-step Triton kernels (RMSNorm, q/k norm + RoPE, softmax top-k routing) against their
torch references on random inputs: bit for bit in bf16 where the roundings allow (on CUDA, else in
Triton's interpreter on the CPU)."""
import pytest
import torch
from tiny import kernel_device

from ktransformers.operators.gate import route_sigmoid_grouped, route_softmax

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def dev():
    return kernel_device()


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rel_max(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def assert_match(out, ref, what):
    """bf16: identical; float32: within a float32 rounding (a different order of summing x^2)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, f"{what}: {out.dtype} {out.shape} vs {ref.dtype} {ref.shape}"
    if ref.dtype == torch.float32:
        assert rel_max(out, ref) < 1e-6, f"{what}: {rel_max(out, ref):.2e}"
    else:
        assert torch.equal(out, ref), f"{what}: {(out != ref).sum().item()} of {ref.numel()} differ"


def rope_tables(B, S, d, dtype, g):
    pos = torch.randint(0, 4096, (B, S), generator=g).float()
    freqs = pos[..., None] / 1e6 ** (torch.arange(0, d, 2).float() / d)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D", [64, 128, 2048, 7168])
def test_rms_norm(dev, dtype, D):
    from ktransformers.kernels.triton.norm_rope import rms_norm, rms_norm_reference
    g = gen(D)
    w = (torch.randn(D, generator=g) * 0.3 + 1).to(dtype).to(dev)
    rows = [(1, D), (2, 3, D)] + ([(2, 3, 4, D)] if D <= 128 else [])
    for shape in rows:
        x = (torch.randn(shape, generator=g) * 3).to(dtype).to(dev)
        assert_match(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), f"{shape}")
    # rows with a stride (a split of a wider projection, as MLA's kv_a_layernorm input)
    wide = (torch.randn(2, 3, D + 64, generator=g)).to(dtype).to(dev)
    x = wide[..., :D]
    assert_match(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5), "strided rows")
    if dtype == torch.bfloat16:  # a float32 weight promotes the result, as torch's product does
        w32 = w.float()
        assert_match(rms_norm(x, w32, 1e-6), rms_norm_reference(x, w32, 1e-6), "float32 weight")
    # the zero-centred norms' order: x's dtype, the float32 product rounded once. One rounding of
    # x * r * w lets an r one float32 step apart (mean(x^2) summed in another order) move a bf16
    # result by one step: a few such steps are allowed, nothing more
    scale = 1.0 + torch.randn(D, generator=g).to(dev) * 0.3
    for shape in rows:
        x = (torch.randn(shape, generator=g) * 3).to(dtype).to(dev)
        got, want = rms_norm(x, scale, 1e-6, round_normed=False), rms_norm_reference(x, scale, 1e-6, round_normed=False)
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        if dtype == torch.float32:
            assert rel_max(got, want) < 1e-6, f"zero-centred {shape}"
        else:
            step = want.float().abs() * 2.0 ** -7  # (at least one bf16 step of the value)
            assert ((got.float() - want.float()).abs() <= step).all(), f"zero-centred {shape}"
            assert (got != want).float().mean().item() < 1e-3, f"zero-centred {shape}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D", [64, 2048, 7168])
def test_add_rms_norm(dev, dtype, D):
    """A decoder layer's residual add and the next norm in one launch: the sum as torch's add
    rounds it, the norm as rms_norm_reference of that sum, bit for bit in bf16."""
    from ktransformers.kernels.triton.norm_rope import add_rms_norm, rms_norm_reference
    g = gen(D + 1)
    w = (torch.randn(D, generator=g) * 0.3 + 1).to(dtype).to(dev)
    for shape in [(1, 1, D), (3, D), (2, 5, D)]:
        a, b = ((torch.randn(shape, generator=g) * 3).to(dtype).to(dev) for _ in range(2))
        s, y = add_rms_norm(a, b, w, 1e-6)
        assert_match(s, a + b, f"sum {shape}")
        assert_match(y, rms_norm_reference(a + b, w, 1e-6), f"norm {shape}")
    with pytest.raises(ValueError, match="add_rms_norm: a"):
        add_rms_norm(a, b[..., :D // 2], w, 1e-6)
    with pytest.raises(ValueError, match=rf"weight must be a contiguous \[{D}\]"):
        add_rms_norm(a, b, w[: D // 2], 1e-6)


@pytest.mark.parametrize("heads,kv_heads,d,B,S,r", [
    (32, 4, 128, 1, 1, 128), (16, 2, 64, 2, 5, 64), (64, 8, 64, 1, 1, 64), (16, 2, 128, 2, 1, 128),
    (32, 4, 64, 1, 5, 64), (12, 2, 128, 1, 1, 64), (8, 2, 128, 2, 3, 64), (6, 2, 96, 1, 2, 32)])
def test_qk_norm_rope(dev, heads, kv_heads, d, B, S, r):
    """q and k as views of one [B, S, (h + 2 h_kv) d] projection (a token stride, not contiguous);
    r < d: partial rotary (GLM-4.5's half), the rest of each head unrotated."""
    from ktransformers.kernels.triton.norm_rope import (
        qk_norm_rope,
        qk_norm_rope_reference,
    )
    g = gen(heads * d + S)
    combos = [(torch.bfloat16, torch.bfloat16, True), (torch.bfloat16, torch.bfloat16, False),
              (torch.bfloat16, torch.float32, True), (torch.float32, torch.float32, True)]
    for dtype, table_dtype, norm in combos[:4 if B * S * heads <= 64 else 2]:
        qkv = torch.randn(B, S, (heads + 2 * kv_heads) * d, generator=g).to(dtype).to(dev)
        q = qkv[..., :heads * d].view(B, S, heads, d)
        k = qkv[..., heads * d:(heads + kv_heads) * d].view(B, S, kv_heads, d)
        cos, sin = (t.to(dev) for t in rope_tables(1, S, r, table_dtype, g))
        cos, sin = cos.expand(B, S, r), sin.expand(B, S, r)  # one table for the batch, as HF passes it
        weights = [(torch.randn(d, generator=g) * 0.3 + 1).to(dtype).to(dev) for _ in range(2)] if norm else [None] * 2
        out = qk_norm_rope(q, k, cos, sin, *weights, eps=(1e-6, 1e-5))
        ref = qk_norm_rope_reference(q, k, cos, sin, *weights, eps=(1e-6, 1e-5))
        for o, want, name in zip(out, ref, "qk"):
            assert_match(o, want, f"{name} {dtype} tables {table_dtype} norm={norm}")
        # gpt-oss's tables: one factor a pair (each half of the full tables is the same), read twice
        half_cos, half_sin = cos[..., :r // 2], sin[..., :r // 2]
        paired = qk_norm_rope(q, k, half_cos, half_sin, *weights, eps=(1e-6, 1e-5), pair_tables=True)
        paired_ref = qk_norm_rope_reference(q, k, half_cos, half_sin, *weights, eps=(1e-6, 1e-5), pair_tables=True)
        for o, want, full, name in zip(paired, paired_ref, out, "qk"):
            assert_match(o, want, f"{name} {dtype} pair tables norm={norm}")
            assert torch.equal(o, full), f"{name}: pair tables differ from the full ones"


@pytest.mark.parametrize("dtype,B,S,r", [(torch.bfloat16, 1, 1, 64), (torch.bfloat16, 2, 3, 64),
                                         (torch.float32, 1, 4, 64), (torch.bfloat16, 1, 1, 32), (torch.float32, 2, 2, 16)])
def test_qk_norm_rope_writes_cache(dev, dtype, B, S, r):
    """With `write`, the launch also stores the rotated k and v at the tokens' slots, as the paged
    cache's index_copy_ would, and leaves every other row of the caches alone (r < 64: the
    partial rotary's unrotated rest stored too)."""
    from ktransformers.kernels.triton.norm_rope import qk_norm_rope, qk_norm_rope_reference
    heads, kv, d, total = 8, 2, 64, 40
    g = gen(B * S + d + r)
    q = torch.randn(B, S, heads, d, generator=g).to(dtype).to(dev)
    k, v = (torch.randn(B, S, kv, d, generator=g).to(dtype).to(dev) for _ in range(2))
    cos, sin = (t.to(dev) for t in rope_tables(B, S, r, dtype, g))
    weights = [(torch.randn(d, generator=g) * 0.3 + 1).to(dtype).to(dev) for _ in range(2)]
    slots = torch.randperm(total, generator=g)[:B * S].to(dev)
    k_cache, v_cache = (torch.randn(total, kv, d, generator=g).to(dtype).to(dev) for _ in range(2))
    want_k, want_v = k_cache.clone(), v_cache.clone()
    qo, ko = qk_norm_rope(q, k, cos, sin, *weights, write=(v, k_cache, v_cache, slots))
    ref_q, ref_k = qk_norm_rope_reference(q, k, cos, sin, *weights)
    assert_match(qo, ref_q, "q")
    assert_match(ko, ref_k, "k")
    want_k.index_copy_(0, slots, ref_k.reshape(-1, kv, d))
    want_v.index_copy_(0, slots, v.reshape(-1, kv, d))
    assert_match(k_cache, want_k, "k cache")
    assert torch.equal(v_cache, want_v)
    with pytest.raises(ValueError, match=r"k_cache must be a contiguous \[slots, 2, 64\]"):
        qk_norm_rope(q, k, cos, sin, *weights, write=(v, k_cache[:, :1], v_cache, slots))
    with pytest.raises(ValueError, match=rf"slots must be \[{B * S}\]"):
        qk_norm_rope(q, k, cos, sin, *weights, write=(v, k_cache, v_cache, slots[:1].expand(2) if B * S == 1 else slots[:1]))
    with pytest.raises(ValueError, match=r"an even rotary dim r <= 64"):
        qk_norm_rope(q, k, cos[..., 1:], sin[..., 1:], *weights)


@pytest.mark.parametrize("T", [1, 3, 64])
def test_softmax_topk(dev, T):
    from ktransformers.kernels.triton.router import softmax_topk
    for E, K in [(8, 2), (8, 4), (60, 4), (60, 8), (128, 2), (128, 8), (256, 4), (256, 8)]:
        norm = (E + K) % 3 != 0  # both, across the grid
        logits = torch.randn(T, E, generator=gen(T * E + K)) * 2
        weights, index = softmax_topk(logits.to(dev), K, norm)
        ref_w, ref_i = route_softmax(logits, top_k=K, norm=norm)
        assert torch.equal(index.cpu(), ref_i), f"E={E} K={K} norm={norm}"
        assert weights.dtype == torch.float32 and rel_max(weights.cpu(), ref_w) < 1e-6, f"E={E} K={K} norm={norm}"
    # bf16 logits (the GPU model's) with Qwen's cast back to bf16 in the kernel's store. They tie
    # often: torch.topk orders equal values in no fixed way, the kernel by the lower index, so the
    # picks are compared by their probabilities
    logits = torch.randn(T, 128, generator=gen(T)).to(torch.bfloat16)
    weights, index = softmax_topk(logits.to(dev), 8, True, torch.bfloat16)
    ref_w, ref_i = route_softmax(logits, top_k=8, norm=True)
    probs = torch.softmax(logits.float(), dim=-1)
    assert weights.dtype == torch.bfloat16 and torch.equal(weights.cpu(), ref_w.to(torch.bfloat16))
    assert torch.equal(probs.gather(1, index.cpu()), probs.gather(1, ref_i))


@pytest.mark.parametrize("T,E,K,H", [(1, 128, 8, 2048), (3, 60, 4, 512), (4, 8, 2, 256), (1, 256, 8, 7168)])
def test_router_topk(dev, T, E, K, H, monkeypatch):
    """The router's GEMV and its top-k epilogue in one launch, against torch: the logits within
    a rounding of x @ W.T (+ a bias: gpt-oss's router; the K split reduced in the launch, or not
    split where one SM is all there is), the routing route_softmax's on those logits, the pack in passing what
    pack_moe_inputs_reference stores, and the tile counters back at 0."""
    from ktransformers.kernels.triton import common, quant_linear
    from ktransformers.kernels.triton.handoff import PinnedInputs, pack_moe_inputs_reference
    from ktransformers.kernels.triton.quant_linear import gemv_plan
    from ktransformers.kernels.triton.router import router_topk
    g = gen(T * E + H)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    w = (torch.randn(E, H, generator=g) * 0.05).to(dev)
    b = torch.randn(E, generator=g)
    for split in (True, False):
        if not split:
            monkeypatch.setattr(common, "sm_count", lambda device: 1)
            monkeypatch.setattr(quant_linear, "sm_count", lambda device: 1)
        if E == 128:  # both launches covered: split on the GPU or the interpreter's 4 SMs, not on 1
            assert gemv_plan(x, E, torch.float32)[3].reduce == split
        for logits_dtype, weights_dtype, bias in ((torch.bfloat16, torch.bfloat16, None),
                                                  (torch.float32, torch.float32, None),
                                                  (torch.bfloat16, torch.bfloat16, b),
                                                  (torch.float32, torch.float32, b)):
            norm = E != 8
            logits, weights, index = router_topk(x, w, K, norm, logits_dtype, weights_dtype,
                                                 bias=None if bias is None else bias.to(dev))
            want = x.cpu().double() @ w.cpu().double().T + (0 if bias is None else bias.double())
            assert logits.dtype == logits_dtype
            assert rel_max(logits.cpu(), want) < (1e-5 if logits_dtype == torch.float32 else 2 ** -7)
            ref_w, ref_i = route_softmax(logits.cpu().float(), top_k=K, norm=norm)
            # the same picks (equal logits may be picked in either order); a GPU build may sum a
            # softmax's terms across warps in another order
            probs = torch.softmax(logits.cpu().float(), dim=-1)
            assert torch.equal(probs.gather(1, index.cpu()), probs.gather(1, ref_i)) and weights.dtype == weights_dtype
            # (relative to the largest weight: one bf16 ulp of a weight in its binade is up to 2^-7)
            assert rel_max(weights.cpu(), ref_w) <= (1e-6 if weights_dtype == torch.float32 else 2 ** -7)
        assert int(common.split_counters(x.device).abs().sum()) == 0
    # the pack in passing: what the packing would store from the same outputs
    for cpu_k, xdt in ((K, torch.bfloat16), (K // 2, torch.float32)):
        views = [torch.full((T, H), -5.0, dtype=xdt), torch.full((T, K), 99, dtype=torch.int64),
                 torch.full((T, K), -5.0)]
        want = [t.clone() for t in views]
        pack = PinnedInputs(*(t.to(dev) for t in views), cpu_k)
        _, weights, index = router_topk(x, w, K, True, torch.bfloat16, torch.bfloat16, pack=pack)
        ref = [t.to(dev) for t in want]
        pack_moe_inputs_reference(x, index, weights, *ref)
        ref[1][:, cpu_k:] = -1  # the columns from cpu_k on are not the CPU's
        assert all(torch.equal(a, b) for a, b in zip((pack.x, pack.ids, pack.weights), ref))
        assert (pack.ids[:, cpu_k:] == -1).all() and (pack.ids[:, :cpu_k] >= 0).all()
        views = (pack.x, pack.ids, pack.weights)
        assert pack.holds(x, index, weights, views, cpu_k) and not pack.holds(x, index.clone(), weights, views, cpu_k)
        assert not pack.holds(x, index, weights, views, cpu_k - 1)
    with pytest.raises(ValueError, match="do not fit"):
        router_topk(x, w, K + 1 if K < E else K - 1, True, torch.bfloat16, torch.bfloat16, pack=pack)
    assert int(common.split_counters(x.device).abs().sum()) == 0
    assert router_topk(torch.randn(5, H).to(dev), w, K, True, torch.float32, torch.float32) is None
    with pytest.raises(ValueError, match=f"bias must be float32 \\[{E}\\]"):
        router_topk(x, w, K, True, torch.float32, torch.float32, bias=b[1:].to(dev))


@pytest.mark.parametrize("T,E,K,H,G,TG", [(1, 128, 8, 1024, 1, 1), (3, 160, 8, 512, 1, 1), (2, 384, 8, 256, 1, 1),
                                          (4, 256, 8, 512, 1, 1), (1, 256, 8, 1024, 8, 4), (3, 64, 6, 256, 8, 3),
                                          (2, 16, 4, 128, 4, 2)])
def test_router_topk_sigmoid(dev, T, E, K, H, G, TG):
    """DeepSeek-V3's sigmoid routing in the router's launch: one group (GLM-4.5-Air's 128
    experts, GLM-4.5's 160, Kimi-K2's 384, MiniMax-M2's 256) or G groups of which TG are kept
    (DeepSeek-V3's 8 and 4 of 256; smaller ones), against route_sigmoid_grouped on the launch's
    logits: the same experts, their weights, with and without the norm and the scale, correction
    biases of both signs (choices below zero order as floats do), and the pack."""
    from ktransformers.kernels.triton.handoff import PinnedInputs, pack_moe_inputs_reference
    from ktransformers.kernels.triton.router import router_topk
    g = gen(T * E + H + 1)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    w = (torch.randn(E, H, generator=g) * 0.05).to(dev)
    for shift, norm, scale in ((0.0, True, 2.5), (-1.0, False, 1.0), (0.5, True, 1.0)):
        bias = torch.randn(E, generator=g) * 0.3 + shift
        logits, weights, index = router_topk(x, w, K, norm, torch.float32, torch.float32,
                                             correction_bias=bias.to(dev), scale=scale, n_group=G, topk_group=TG)
        want = x.cpu().double() @ w.cpu().double().T
        assert logits.dtype == torch.float32 and rel_max(logits.cpu(), want) < 1e-5
        ref_w, ref_i = route_sigmoid_grouped(logits.cpu(), bias, top_k=K, n_group=G, topk_group=TG, norm=norm,
                                             scale=scale)
        got_i, order = index.cpu().sort(dim=-1)
        want_i, want_order = ref_i.sort(dim=-1)
        assert torch.equal(got_i, want_i), f"shift {shift}: other experts picked"
        assert weights.dtype == torch.float32
        assert rel_max(weights.cpu().gather(1, order), ref_w.gather(1, want_order)) < 1e-6, f"shift {shift}"
        choice = logits.cpu().sigmoid() + bias  # in descending order of the choice
        picked = choice.gather(1, index.cpu())
        assert (picked[:, :-1] >= picked[:, 1:]).all()
        if G > 1:  # (the groups mattered: the best K of all experts is another set somewhere)
            best_any = choice.topk(K, dim=-1)[1].sort(dim=-1)[0]
            assert not torch.equal(best_any, got_i) or shift != 0.0
        if shift == 0.0:  # (the same GEMV as the softmax route: the correction bias only picks)
            plain, _, _ = router_topk(x, w, K, norm, torch.float32, torch.float32)
            assert torch.equal(plain, logits)
    views = [torch.full((T, H), -5.0), torch.full((T, K), 99, dtype=torch.int64), torch.full((T, K), -5.0)]
    want = [t.clone() for t in views]
    pack = PinnedInputs(*(t.to(dev) for t in views), K)
    _, weights, index = router_topk(x, w, K, True, torch.float32, torch.float32, pack=pack,
                                    correction_bias=bias.to(dev), scale=2.5, n_group=G, topk_group=TG)
    ref = [t.to(dev) for t in want]
    pack_moe_inputs_reference(x, index, weights, *ref)
    assert all(torch.equal(a, b) for a, b in zip((pack.x, pack.ids, pack.weights), ref))
    with pytest.raises(ValueError, match=f"router_topk \\(correction\\): bias must be float32 \\[{E}\\]"):
        router_topk(x, w, K, True, torch.float32, torch.float32, correction_bias=bias[1:].to(dev))
    with pytest.raises(ValueError, match="give a correction_bias"):
        router_topk(x, w, K, True, torch.float32, torch.float32, n_group=2)
    with pytest.raises(ValueError, match="topk_group 3 of n_group 2"):
        router_topk(x, w, K, True, torch.float32, torch.float32, correction_bias=bias.to(dev), n_group=2, topk_group=3)
    if G > 1:  # groups of a number of experts the launch cannot split: torch's ops instead
        w2 = (torch.randn(E - G, H, generator=g) * 0.05).to(dev)
        assert router_topk(x, w2, K, True, torch.float32, torch.float32, correction_bias=bias[G:].to(dev),
                           n_group=G, topk_group=TG) is None


def test_router_topk_sigmoid_nan_stays_in_range(dev):
    """NaN logits through the sigmoid route: NaN weights, ids in [0, E), none picked twice."""
    from ktransformers.kernels.triton.router import router_topk
    x = torch.randn(2, 64, generator=gen(11)).to(dev)
    x[0, 3] = float("nan")  # the whole first row of logits is NaN
    w = torch.randn(40, 64, generator=gen(12)).to(dev)
    _, weights, index = router_topk(x, w, 6, True, torch.float32, torch.float32,
                                    correction_bias=torch.randn(40, generator=gen(13)).to(dev))
    index = index.cpu()
    assert ((index >= 0) & (index < 40)).all()
    assert all(len(set(row.tolist())) == 6 for row in index)
    assert weights[0].isnan().all() and not weights[1].isnan().any()


@pytest.mark.parametrize("family", ["glm4_moe", "minimax_m2", "deepseek_v3"])
def test_sigmoid_router_operator(dev, family):
    """KMoEGate where Triton runs: logits and routing in one launch, with one group (GLM-4.5,
    MiniMax-M2) or several (DeepSeek-V3), the same experts and weights as route_sigmoid_grouped on
    its logits."""
    from test_operators import DictSource
    from tiny import tiny_model

    from ktransformers.operators.gate import KMoEGate
    hf = tiny_model(family, layers=2)
    key = next(n for n, m in hf.named_modules() if type(m).__name__.endswith(("TopkRouter", "TopKRouter")))
    router = hf.get_submodule(key).to(torch.bfloat16)  # (a float32 one runs on the C++ GEMV on a CPU)
    state = {k: v for k, v in hf.state_dict().items() if k.startswith(key.rsplit(".", 1)[0] + ".")}
    bias_key = next(k for k in state if k.endswith("e_score_correction_bias"))
    state[bias_key] = torch.randn(router.weight.shape[0], generator=gen(5)) * 0.3  # (HF starts it at 0)
    op = KMoEGate(key, DictSource(state), hf.config, router, generate_device=dev, prefill_device=dev)
    op.load()
    assert op.fused and (op.n_group == 1) == (family != "deepseek_v3")
    x = torch.randn(3, hf.config.hidden_size, generator=gen(4)).to(dev)
    logits, weights, index = op(x)
    ref_w, ref_i = route_sigmoid_grouped(logits.cpu(), op.bias.cpu(), top_k=op.top_k, n_group=op.n_group,
                                         topk_group=op.topk_group, norm=op.norm, scale=op.scale)
    got_i, order = index.cpu().sort(dim=-1)
    want_i, want_order = ref_i.sort(dim=-1)
    assert torch.equal(got_i, want_i)
    assert rel_max(weights.cpu().gather(1, order), ref_w.gather(1, want_order)) < 1e-6


def test_softmax_topk_nan_logits_stay_in_range(dev):
    """A NaN logit (a broken model or input) gives NaN weights, never an expert id outside [0, E):
    a graph-replayed decode step does not check the ids before the experts index with them."""
    from ktransformers.kernels.triton.router import softmax_topk
    logits = torch.randn(3, 60, generator=gen(9))
    logits[0] = float("nan")  # a whole row
    logits[1, 7] = float("nan")  # one logit: its softmax row is all NaN too
    weights, index = softmax_topk(logits.to(dev), 4, True)
    index, weights = index.cpu(), weights.cpu()
    assert ((index >= 0) & (index < 60)).all(), index
    assert all(len(set(row.tolist())) == 4 for row in index)  # distinct picks
    assert weights[:2].isnan().all()
    ref_w, ref_i = route_softmax(logits[2:], top_k=4, norm=True)  # the clean row is unaffected
    assert torch.equal(index[2:], ref_i) and rel_max(weights[2:], ref_w) < 1e-6


def test_bad_inputs(dev):
    from ktransformers.kernels.triton.norm_rope import qk_norm_rope, rms_norm
    from ktransformers.kernels.triton.router import softmax_topk
    with pytest.raises(ValueError, match=r"rms_norm: weight must be a contiguous \[64\]"):
        rms_norm(torch.randn(2, 64, device=dev), torch.ones(32, device=dev), 1e-6)
    q, k = torch.randn(1, 1, 4, 64, device=dev), torch.randn(1, 1, 2, 64, device=dev)
    with pytest.raises(ValueError, match=r"cos must be \[1, 1, r\] with an even rotary dim r <= 64, got \(1, 1, 66\)"):
        qk_norm_rope(q, k, torch.ones(1, 1, 66, device=dev), torch.ones(1, 1, 66, device=dev))
    with pytest.raises(ValueError, match=r"sin must be \[1, 1, 32\]"):
        qk_norm_rope(q, k, torch.ones(1, 1, 32, device=dev), torch.ones(1, 1, 64, device=dev))
    with pytest.raises(ValueError, match=r"cos must be \[1, 1, r / 2\] \(pair tables\) with an even rotary dim r <= 64"):
        qk_norm_rope(q, k, torch.ones(1, 1, 64, device=dev), torch.ones(1, 1, 64, device=dev), pair_tables=True)
    with pytest.raises(ValueError, match="top_k 9 of 8 experts"):
        softmax_topk(torch.randn(1, 8, device=dev), 9, True)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_softmax_router_operator(dev, family):
    """KMoEGateSoftmax with bf16 weights (as on the GPU) routes through the kernel, same result as
    route_softmax on its logits, weights cast back to bf16 for Qwen only."""
    from test_operators import prefixed
    from tiny import tiny_config
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from ktransformers.operators.gate import KMoEGateSoftmax
    config = tiny_config(family)
    hf = (Qwen3MoeTopKRouter if family == "qwen3_moe" else MixtralTopKRouter)(config).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.normal_(0, 0.1, generator=gen(3))
    op = KMoEGateSoftmax("g", prefixed("g", hf), config, hf, generate_device=dev, prefill_device=dev)
    op.load()
    assert op.triton_route is not None
    x = torch.randn(3, config.hidden_size, generator=gen(4)).to(torch.bfloat16).to(dev)
    logits, weights, index = op(x)
    ref_w, ref_i = route_softmax(logits, top_k=op.top_k, norm=op.norm)
    probs = torch.softmax(logits.float(), dim=-1)
    want = ref_w.to(torch.bfloat16) if family == "qwen3_moe" else ref_w
    assert weights.dtype == want.dtype and (weights.float() - want.float()).abs().max() <= 1e-6
    assert torch.equal(probs.gather(1, index), probs.gather(1, ref_i))
