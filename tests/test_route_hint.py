"""Route hints (operators/route_hint.py, RouteHint in csrc/moe.h): the folded router, the C++
guess against torch's ranking, the read-ahead's byte counts, the doorbell reading ahead after a
one-token call and scoring its guess against the next call, and the model-level linking."""
import ctypes
import time

import pytest
import torch
from test_models import q4_k_m
from tiny import RULES, tiny_model

from ktransformers import optimize_and_load_gguf
from ktransformers.kernels.cpu import CPURuntime, ExpertWeights, MoEKernel
from ktransformers.kernels.cuda_host import HostStaging
from ktransformers.loader import RULES_DIR, build_skeleton
from ktransformers.operators.route_hint import RouteHint, decoder_layers, folded_router, link_route_hints
from ktransformers.weights.ggml_quants import FORMATS, GGMLType, random_blocks
from ktransformers.weights.gguf_write import write_gguf


def _kernel(runtime, E, K, H, I, seed=0, t=GGMLType.Q8_0):
    g = torch.Generator().manual_seed(seed)
    w = [ExpertWeights(random_blocks(t, E * r * c // FORMATS[t].block_elems, g).reshape(-1), int(t))
         for r, c in ((I, H), (I, H), (H, I))]
    return MoEKernel(runtime, experts=E, top_k=K, hidden=H, intermediate=I, gate=w[0], up=w[1], down=w[2])


def test_folded_router_ranks_as_the_next_router_on_the_unchanged_residual():
    """router(n' * h / rms(h)) and folded(n, n') @ (n * h / rms(h)) are the same logits (to bf16
    rounding of the folded weights); columns where n is 0 are dropped, not divided by."""
    g = torch.Generator().manual_seed(3)
    for E, H in ((16, 64), (128, 256), (7, 96)):
        router = torch.randn(E, H, generator=g)
        n, n_next = torch.rand(H, generator=g) + 0.1, torch.randn(H, generator=g)
        h = torch.randn(H, generator=g) * 30
        x = n * h / h.pow(2).mean().sqrt()
        want = router @ (n_next * h / h.pow(2).mean().sqrt())
        got = folded_router(router, n, n_next).float() @ x
        assert torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
        n[:5] = 0
        folded = folded_router(router, n, n_next)
        assert torch.isfinite(folded.float()).all() and (folded[:, :5] == 0).all()
    with pytest.raises(ValueError, match="two norm weights"):
        folded_router(torch.randn(4, 8), torch.ones(8), torch.ones(9))


def test_guess_is_the_top_k_of_the_folded_logits():
    runtime = CPURuntime(2)
    g = torch.Generator().manual_seed(4)
    for E, K, H in ((6, 2, 256), (128, 8, 512), (33, 5, 256)):
        kernel = _kernel(runtime, E, K, H, 64)
        for _ in range(4):
            router = torch.randn(E, H, generator=g).to(torch.bfloat16)
            x = torch.randn(H, generator=g) * 3
            logits = router.float() @ x
            guess = kernel.guess(router, x)
            assert len(guess) == K and len(set(guess)) == K and all(0 <= e < E for e in guess)
            kth = torch.topk(logits, K).values[-1]
            assert all(logits[e] >= kth - 1e-3 * logits.abs().max() for e in guess), (guess, torch.topk(logits, K))
            assert logits[guess[0]] >= logits.max() - 1e-3 * logits.abs().max()  # highest first
    with pytest.raises(ValueError, match="router must be contiguous CPU bfloat16"):
        kernel.guess(torch.randn(E, H), torch.randn(H))
    with pytest.raises(ValueError, match="x must be"):
        kernel.guess(torch.randn(E, H).to(torch.bfloat16), torch.randn(H + 1))


def test_warm_reads_the_experts_bytes_within_the_budget():
    runtime = CPURuntime(2)
    E, K, H, I = 10, 3, 256, 512
    kernel = _kernel(runtime, E, K, H, I, t=GGMLType.Q4_K)
    per_expert = 3 * H * I // 256 * FORMATS[GGMLType.Q4_K].block_bytes
    assert kernel.warm([1, 4, 9], 10**9) == 3 * per_expert
    assert kernel.warm([2, 2], 10**9) == 2 * per_expert  # (what it is asked, twice)
    assert kernel.warm([-1, E, 10**6], 10**9) == 0  # ids outside the layer: skipped
    assert kernel.warm([0, 1], 0) == 0
    for budget in (1, 5000, 70_000, per_expert + 3):
        got = kernel.warm([0, 5, 7], budget)
        assert budget <= got < budget + 64 * 1024, (budget, got)


def _word(address: int) -> ctypes.c_uint32:
    return ctypes.c_uint32.from_address(address)


def _ring(staging, kernel, T):
    ring, done = staging.flags(kernel)
    _word(ring).value = staging.number(kernel, T, torch.float32)
    staging.wake()
    deadline = time.monotonic() + 10
    while _word(done).value != 1:
        assert time.monotonic() < deadline, "the doorbell never set done"
        time.sleep(1e-4)
    _word(done).value = 0


def test_doorbell_reads_ahead_and_scores_its_guess():
    """After a one-token call of a hinted layer, the doorbell guesses the next layer's experts
    from the call's input and reads them; the next call counts how many of them it took. The
    outputs of both layers are the kernels' own. Calls of more tokens, and set_route_hints(False),
    read nothing ahead."""
    runtime = CPURuntime(2)
    E, K, H, I = 12, 3, 256, 256
    first, second = _kernel(runtime, E, K, H, I, seed=1), _kernel(runtime, E, K, H, I, seed=2)
    g = torch.Generator().manual_seed(6)
    router = torch.randn(E, H, generator=g).to(torch.bfloat16)
    first.route_hint = RouteHint(second, router)
    staging = HostStaging(runtime, pinned=False)
    per_expert = 3 * H * I // 32 * FORMATS[GGMLType.Q8_0].block_bytes
    try:
        for take_guess in (True, False, True):
            x, ids, w, y, _ = staging.prepare(first, 1, torch.float32)
            x.copy_(torch.randn(1, H, generator=g))
            ids.copy_(torch.randperm(E, generator=g)[:K].view(1, K))
            w.copy_(torch.rand(1, K, generator=g))
            x0, ids0, w0 = x.clone(), ids.clone(), w.clone()
            guess = first.route_hint.next.guess(router, x0[0])
            bell = staging.doorbell
            before = (bell.warm_bytes, bell.hint_guessed, bell.hint_hits) if bell is not None else (0, 0, 0)
            _ring(staging, first, 1)
            assert torch.equal(y, first.forward(x0, ids0, w0))
            bell = staging.doorbell
            deadline = time.monotonic() + 5  # the read-ahead runs after done: all K experts (~2 ms at most)
            while bell.warm_bytes - before[0] < K * per_expert:
                assert time.monotonic() < deadline, f"read {bell.warm_bytes - before[0]} bytes ahead"
                time.sleep(1e-3)
            assert bell.warm_bytes - before[0] == K * per_expert
            x, ids, w, y, _ = staging.prepare(second, 1, torch.float32)  # (the same pinned area)
            x.copy_(torch.randn(1, H, generator=g))
            others = [e for e in range(E) if e not in guess]
            ids.copy_(torch.tensor([guess if take_guess else others[:K]]))
            w.copy_(torch.rand(1, K, generator=g))
            x1, ids1, w1 = x.clone(), ids.clone(), w.clone()
            _ring(staging, second, 1)
            assert torch.equal(y, second.forward(x1, ids1, w1))
            assert bell.hint_guessed - before[1] == K
            assert bell.hint_hits - before[2] == (K if take_guess else 0)
        for T, on in ((2, True), (1, False)):
            runtime.ext.set_route_hints(on)
            x, ids, w, y, _ = staging.prepare(first, T, torch.float32)
            x.copy_(torch.randn(T, H, generator=g))
            ids.copy_(torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]))
            w.copy_(torch.rand(T, K, generator=g))
            before = bell.warm_bytes
            _ring(staging, first, T)
            time.sleep(0.01)
            assert bell.warm_bytes == before, (T, on)
    finally:
        runtime.ext.set_route_hints(True)
    staging.check_errors()


def test_warm_stops_at_its_word_and_its_deadline():
    """The read-ahead ends when its stop word (the next layer's ring) is set, or at its deadline:
    set before it starts, nothing is read; a word set by another thread meanwhile ends it early."""
    import threading
    runtime = CPURuntime(2)
    E, H, I = 8, 512, 2048  # 8 experts of 3 x 1 M values in Q8_0: 27 MB
    kernel = _kernel(runtime, E, 8, H, I, seed=3)
    full = E * 3 * H * I // 32 * FORMATS[GGMLType.Q8_0].block_bytes
    stop = torch.zeros(1, dtype=torch.int32)
    assert kernel.warm(range(E), 10**9, stop=stop) == full
    stop[0] = 1
    assert kernel.warm(range(E), 10**9, stop=stop) == 0
    assert kernel.warm(range(E), 10**9, max_seconds=0) == 0
    stop[0] = 0
    got = []

    def reader():  # reads the layer over and over until a read ends short
        while True:
            got.append(kernel.warm(range(E), 10**9, max_seconds=30, stop=stop))
            if got[-1] < full:
                return
    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(0.005)
    stop[0] = 1
    thread.join(timeout=30)
    assert not thread.is_alive() and got[-1] < full, got[-3:]


def test_next_layer_rung_at_once_is_served_and_right():
    """The next layer rung right after the hinted call (its read-ahead running or not yet begun)
    is served, and right, call after call."""
    runtime = CPURuntime(2)
    E, K, H = 8, 8, 512
    first, second = _kernel(runtime, E, 2, H, 64, seed=3), _kernel(runtime, E, K, H, 2048, seed=4)
    first.route_hint = RouteHint(second, torch.randn(E, H).to(torch.bfloat16))
    staging = HostStaging(runtime, pinned=False)
    g = torch.Generator().manual_seed(7)
    for _ in range(5):
        x, ids, w, y, _ = staging.prepare(first, 1, torch.float32)
        x.copy_(torch.randn(1, H, generator=g)), ids.copy_(torch.tensor([[0, 1]])), w.copy_(torch.rand(1, 2))
        _ring(staging, first, 1)
        x, ids, w, y, _ = staging.prepare(second, 1, torch.float32)
        x.copy_(torch.randn(1, H, generator=g)), ids.copy_(torch.randperm(E, generator=g).view(1, K))
        w.copy_(torch.rand(1, K, generator=g))
        x1, ids1, w1 = x.clone(), ids.clone(), w.clone()
        _ring(staging, second, 1)
        assert torch.equal(y, second.forward(x1, ids1, w1))
    assert staging.doorbell.warm_bytes > 0 and staging.doorbell.hint_guessed == 5 * K
    staging.check_errors()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_link_route_hints(tmp_path, monkeypatch, family):
    """Every decoder layer whose CPU experts are followed by another CPU-experts layer gets the
    next layer's router folded with both layers' norm weights; KT_ROUTE_HINT=0 links none."""
    hf = tiny_model(family, layers=3)
    write_gguf(tmp_path / "m.gguf", hf.config, hf.state_dict(), types=q4_k_m)
    model = build_skeleton(hf.config, torch.float32)
    optimize_and_load_gguf(model, RULES_DIR / RULES[family], tmp_path / "m.gguf", hf.config)  # (CPU experts)
    layers = decoder_layers(model)
    kernels = [getattr(getattr(getattr(l.mlp, "experts", None), "ops", {}).get("generate"), "kernel", None)
               for l in layers]
    moe = [i for i, k in enumerate(kernels) if k is not None]
    assert len(moe) >= 2, f"{family}: the tiny model needs two CPU-experts layers ({moe})"
    for i, k in enumerate(kernels):
        if k is None:
            continue
        if i + 1 in moe:
            a, b = layers[i], layers[i + 1]
            want = folded_router(b.mlp.gate.weight, a.post_attention_layernorm.weight,
                                 b.post_attention_layernorm.weight)
            assert k.route_hint is not None and k.route_hint.next is kernels[i + 1]
            assert torch.equal(k.route_hint.router, want)
        else:
            assert k.route_hint is None
    monkeypatch.setenv("KT_ROUTE_HINT", "0")
    assert link_route_hints(model) == 0 and all(k is None or k.route_hint is None for k in kernels)
    monkeypatch.setenv("KT_ROUTE_HINT", "1")
    assert link_route_hints(model) == len(moe) - 1
