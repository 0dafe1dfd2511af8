"""Hybrid linear-attention models (Qwen3-Next, Qwen3.5-MoE): the recurrent-state cache, the gated DeltaNet operator
against transformers' own layer, and the engine and server over both kinds of layer."""
import time

import pytest
import torch
from tiny import (HYBRID, RULES, logits_of_both_plans, record_cpu_steps, tiny_model, train_tokenizer,
                  two_at_once_as_alone, wait_all)

from ktransformers import optimize_and_load_gguf
from ktransformers.cache import CacheFullError, HybridCache
from ktransformers.cache.recurrent import RING
from ktransformers.engine.generate import Engine
from ktransformers.engine.sampling import SamplingParams
from ktransformers.loader import build_skeleton
from ktransformers.optimize.skeleton import RULES_DIR
from ktransformers.weights.ggml_quants import GGMLType
from ktransformers.weights.gguf_write import write_gguf


def _loaded(tmp_path, rules=None, seed=0, family="qwen3_next", types=None):
    """A tiny hybrid model and its GGUF (F32 unless `types` says, in llama.cpp's layout: Qwen3.5's
    value heads tiled) loaded through `rules` (default: the shipped CPU file)."""
    hf = tiny_model(family, seed=seed)
    write_gguf(tmp_path / "m.gguf", hf.config, hf.state_dict(), types=types or (lambda name, shape: GGMLType.F32))
    model = build_skeleton(hf.config, torch.float32)
    optimize_and_load_gguf(model, rules or RULES_DIR / RULES[family], tmp_path / "m.gguf", hf.config)
    return hf, model


def _forward_last(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1]


def test_hybrid_cache_keeps_states_for_the_last_lengths_only():
    config = tiny_model("qwen3_next").config
    cache = HybridCache(config, cache_lens=64, page_size=4, max_seqs=2)
    assert cache.layers[0] == [] and len(cache.layers[3]) == 2  # K/V for the full-attention layer only
    a, b = cache.new_sequence(), cache.new_sequence()
    batch = cache.prepare([a, b], [5, 3])
    assert batch.state_fresh == [True, True] and len(set(batch.state_read + batch.state_write)) == 4
    for _ in range(4):  # lengths 6 .. 9 of a
        cache.prepare([a], [1])
    assert [cache.restorable(a, n) for n in (9, 8, 7, 6, 5)] == [9, 8, 7, 0, 0]
    with pytest.raises(ValueError, match="cannot go back to 6"):
        cache.truncate(a, 6)
    cache.truncate(a, 7)
    nxt = cache.prepare([a], [1])  # reads the copy of length 7, writes another
    assert a.length == 8 and nxt.state_read[0] // RING == nxt.state_write[0] // RING
    assert nxt.state_read[0] != nxt.state_write[0] and not nxt.state_fresh[0]
    with pytest.raises(CacheFullError, match="recurrent states of 2 sequences"):
        cache.prepare([cache.new_sequence()], [1])
    cache.free(b)
    assert cache.prepare([cache.new_sequence()], [2]).state_fresh == [True]
    with pytest.raises(ValueError, match="pages hold no recurrent states"):
        cache.export_pages(a, 1)


@pytest.mark.parametrize("family", HYBRID)
@pytest.mark.parametrize("shape", [(1, 1), (2, 7), (3, 19)])
def test_gated_deltanet_equals_transformers_layer(tmp_path, shape, family):
    """The operator (C++ delta rule on the CPU) against transformers' own gated DeltaNet layer on
    the same weights, on random hidden states of several shapes, with no cache."""
    hf, model = _loaded(tmp_path, family=family)
    x = torch.randn(*shape, hf.config.hidden_size, generator=torch.Generator().manual_seed(sum(shape)))
    with torch.no_grad():
        want = hf.model.layers[1].linear_attn(x)
        got = model.model.layers[1].linear_attn(x)
    assert type(model.model.layers[1].linear_attn).__name__ == "KGatedDeltaNet"
    assert ((got - want).norm() / want.norm()).item() < 1e-5


@pytest.mark.parametrize("family", HYBRID)
@pytest.mark.parametrize("path", ["cpp", "torch_ops", pytest.param("triton", marks=pytest.mark.triton)])
def test_batched_steps_over_states_equal_each_sequence_alone(tmp_path, path, family, monkeypatch):
    """Three sequences of different lengths prefilled in chunks, then decoded together in batched
    steps, give each one's own full forward; steps taken back (drop) and redone give them again.
    The decode steps' delta rule: the C++ kernel, transformers' torch functions, or the GPU's
    one-launch kernel (here in Triton's interpreter)."""
    hf, model = _loaded(tmp_path, family=family)
    if path != "cpp":
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn._runtime = None
    if path == "triton":
        from tiny import kernel_device

        from ktransformers.kernels.triton.common import runs_on
        from ktransformers.operators.deltanet import KGatedDeltaNet
        if kernel_device() == "cuda":  # (it skips where the interpreter cannot run either)
            pytest.skip("this model is on the CPU, where the kernel runs only under Triton's interpreter; "
                        "on a GPU test_gpu_rules_decode_with_cuda_graphs_over_the_states runs it")
        monkeypatch.setattr(KGatedDeltaNet, "triton_decodes", lambda self, device: runs_on(device))
        calls = []
        real = KGatedDeltaNet._decode_triton
        monkeypatch.setattr(KGatedDeltaNet, "_decode_triton", lambda self, *a: calls.append(1) or real(self, *a))
    engine = Engine(model, cache_lens=256, page_size=8, chunk_size=6, max_batch=4)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in (4, 11, 17)]
    seqs = [engine.new_sequence() for _ in prompts]
    nexts = [int(engine.prefill(s, p)[0].argmax()) for s, p in zip(seqs, prompts)]
    histories = [p + [t] for p, t in zip(prompts, nexts)]
    for step in range(4):
        logits = engine.step(seqs, [[t] for t in nexts])
        for i, h in enumerate(histories):
            want = _forward_last(hf, h)
            assert ((logits[i] - want).norm() / want.norm()).item() < 1e-4, (step, i)
        nexts = [int(row.argmax()) for row in logits]
        for h, t in zip(histories, nexts):
            h.append(t)
        if step == 1:  # issue two steps and take them back: the states return to where they were
            first = engine.issue(seqs, nexts, [None] * 3, fed=list(nexts))
            second = engine.issue(seqs, first.out, [None] * 3)
            engine.drop([first, second])
    for s in seqs:
        engine.release(s)
    if path == "triton":
        assert calls, "the decode steps did not run the Triton kernel"


@pytest.mark.parametrize("family", HYBRID)
def test_cpu_decode_layer_equals_module_by_module(tmp_path, family):
    """KDecoderLayer's CPU decode step over a hybrid's layers (the DeltaNet layers' one-token step
    on their kernels, the gated attention's queries and gate, the sigmoid-gated shared expert by
    direct calls) gives the same logits, to the bit, as the layers run module by module, on Q8_0
    weights; two sequences in one step go module by module, each as when alone."""
    from ktransformers.cache.recurrent import linear_layers
    from ktransformers.operators.layer import KDecoderLayer
    hf, model = _loaded(tmp_path, family=family, types=GGMLType.Q8_0)
    layers = [m for m in model.modules() if isinstance(m, KDecoderLayer)]
    plans = [m.plan.cpu_decode for m in layers]
    assert len(layers) == hf.config.num_hidden_layers and None not in plans
    assert [i for i, p in enumerate(plans) if p.mixer is not None] == linear_layers(hf.config)
    assert all(p.gated and p.shared is not None for p in plans if p.mixer is None)
    took = record_cpu_steps(layers)
    ids = torch.randint(0, hf.config.vocab_size, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    results = logits_of_both_plans(model, layers, ids, 13)
    assert sum(took) == len(layers) * (len(ids) - 13)
    assert torch.equal(results[0], results[1])
    for m in layers:
        m.cpu_decode = True
    two_at_once_as_alone(model, ids, took)


def test_chat_reuses_the_states_and_server_answers_as_generate(tmp_path):
    """A second prompt that extends the first (a chat turn) computes only its new tokens; the
    scheduler's batched answers (prefix cache off for this model) equal generate's one by one; a
    request cancelled mid-answer gives its pages and state slot back."""
    from ktransformers.server.scheduler import Request, Scheduler
    hf, model = _loaded(tmp_path)
    hf.config.eos_token_id = None
    engine = Engine(model, cache_lens=256, page_size=8, chunk_size=8, max_batch=4)
    g = torch.Generator().manual_seed(4)
    first = torch.randint(0, hf.config.vocab_size, (9,), generator=g).tolist()
    seq = engine.new_sequence()
    answer = list(engine.generate(first, max_new_tokens=5, seq=seq).token_ids())
    turn = first + answer + torch.randint(0, hf.config.vocab_size, (4,), generator=g).tolist()
    again = list(engine.generate(turn, max_new_tokens=3, seq=seq).token_ids())
    assert engine.last_prefill_tokens < len(turn) - len(first)  # the answer's states were kept
    fresh = engine.new_sequence()
    assert again == list(engine.generate(turn, max_new_tokens=3, seq=fresh).token_ids())
    engine.release(seq)
    engine.release(fresh)

    tokenizer = train_tokenizer(hf.config.vocab_size)
    tokenizer.eos_token = None
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in (3, 10, 21)]
    params = [SamplingParams(do_sample=False), SamplingParams(temperature=0.8, seed=2), SamplingParams(do_sample=False)]
    expected = [list(engine.generate(p, q, 8).token_ids()) for p, q in zip(prompts, params)]
    sched = Scheduler(engine, tokenizer, max_batch=4)
    assert sched.pool is None
    try:
        reqs = [Request(p, q, 8) for p, q in zip(prompts, params)]
        for r in reqs:
            sched.submit(r)
        wait_all(reqs, 120)
    finally:
        sched.close()
    assert [r.tokens for r in reqs] == expected
    assert engine.cache.free_seqs == engine.cache.max_seqs
    sched = Scheduler(engine, tokenizer, max_batch=4)  # a client gone mid-answer gives its state slot back
    try:
        gone, stays = Request(prompts[1], params[0], 200), Request(prompts[2], params[0], 6)
        sched.submit(gone)
        sched.submit(stays)
        deadline = time.monotonic() + 120
        while len(gone.tokens) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        gone.cancel()
        wait_all([gone, stays], 120)
    finally:
        sched.close()
    assert gone.finish_reason == "cancelled" and len(gone.tokens) < 200 and stays.tokens == expected[2][:6]
    assert engine.cache.free_seqs == engine.cache.max_seqs and len(engine.cache._free) == engine.cache.num_pages
    with pytest.raises(ValueError, match="recurrent states for 4 sequences"):
        Scheduler(engine, tokenizer, max_batch=8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(1, 1), (3, 1), (1, 37), (2, 70)])
def test_fla_delta_rule_equals_the_torch_functions(shape):
    """flash-linear-attention's kernels (the GPU path) against transformers' torch functions on
    random inputs with grouped value heads and a carried state."""
    from ktransformers.operators.deltanet import delta_rule_fla, delta_rule_torch, fla_available
    if not fla_available():
        pytest.skip("flash-linear-attention is not installed")
    n, T = shape
    g = torch.Generator().manual_seed(T)
    q, k = (torch.randn(n, T, 2, 32, generator=g) for _ in range(2))
    v = torch.randn(n, T, 4, 32, generator=g)
    gate = -torch.rand(n, T, 4, generator=g)
    beta = torch.rand(n, T, 4, generator=g)
    state = torch.randn(n, 4, 32, 32, generator=g) * 0.1
    want, want_state = delta_rule_torch(q, k, v, gate, beta, state.clone())
    got, got_state = delta_rule_fla(*(t.cuda() for t in (q, k, v, gate, beta, state)))
    # (the chunked kernel's dots run on TF32 tensor cores: 1.5e-3 seen on an H100)
    assert ((got.cpu() - want).norm() / want.norm()).item() < 5e-3
    assert ((got_state.cpu() - want_state).norm() / want_state.norm()).item() < 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", HYBRID)
def test_gpu_rules_decode_with_cuda_graphs_over_the_states(tmp_path, family):
    """The GPU rule file (float32) with CUDA graphs: batched decode steps replay graphs that read
    and write the recurrent states by static rows, and give each sequence's own full forward;
    steps issued ahead and dropped leave the states as they were."""
    from tiny import gpu_rules
    hf, model = _loaded(tmp_path, rules=gpu_rules(family, tmp_path, "cuda"), family=family)
    engine = Engine(model, cache_lens=256, page_size=16, chunk_size=8, use_cuda_graph=True, max_batch=4)
    assert engine.graphs is not None and engine.decodes_ahead()
    mixers = [layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn")]
    assert mixers and all(m.triton_decodes(torch.device("cuda")) for m in mixers)  # the one-launch decode kernel
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in (5, 12, 20)]
    seqs = [engine.new_sequence() for _ in prompts]
    nexts = [int(engine.prefill(s, p)[0].argmax()) for s, p in zip(seqs, prompts)]
    histories = [p + [t] for p, t in zip(prompts, nexts)]
    for step in range(4):
        logits = engine.step(seqs, [[t] for t in nexts]).cpu()
        for i, h in enumerate(histories):
            want = _forward_last(hf, h)
            # (the GPU file's linears keep F32 weights as bf16, fla's chunked prefill runs on TF32:
            # 2.7e-3 seen on an H100; a state read or written wrong gives ~1)
            assert ((logits[i] - want).norm() / want.norm()).item() < 2e-2, (step, i)
        nexts = [int(row.argmax()) for row in logits]
        for h, t in zip(histories, nexts):
            h.append(t)
        if step == 1:
            first = engine.issue(seqs, nexts, [None] * 3, fed=list(nexts))
            second = engine.issue(seqs, first.out, [None] * 3)
            engine.drop([first, second])
    assert 3 in engine.graphs.batch_sizes
