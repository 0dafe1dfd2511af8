"""The engine over the paged caches: cached decode equals a full recompute for every family,
page boundaries, batched sequences, cache limits, sampling determinism and stop strings."""
import re

import pytest
import torch
from tiny import (FAMILIES, RULES, logits_of_both_plans, record_cpu_steps, reference_rules, tiny_model, train_tokenizer,
                  two_at_once_as_alone)

from ktransformers import optimize_and_load_gguf
from ktransformers.cache import CacheFullError, KDeepSeekV3Cache, KGQACache, PagedCache
from ktransformers.engine.generate import Engine
from ktransformers.engine.sampling import SamplingParams
from ktransformers.loader import RULES_DIR, build_skeleton
from ktransformers.weights.ggml_quants import GGMLType
from ktransformers.weights.gguf_write import tokenizer_metadata, write_gguf

TOL = 1e-4


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def load(tmp_path, family, reference_ops=True, types=GGMLType.F32, tokenizer=None, layers=2):
    model = tiny_model(family, layers=layers)
    meta = tokenizer_metadata(tokenizer) if tokenizer is not None else None
    write_gguf(tmp_path / "m.gguf", model.config, model.state_dict(), types=types, extra_metadata=meta)
    rules = reference_rules(family, tmp_path) if reference_ops else RULES_DIR / RULES[family]
    ours = build_skeleton(model.config, torch.float32)
    optimize_and_load_gguf(ours, rules, tmp_path / "m.gguf", model.config)
    return ours, model


def full_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_decode_equals_full_recompute(tmp_path, family):
    ours, hf = load(tmp_path, family)
    ids = torch.randint(0, hf.config.vocab_size, (50,), generator=torch.Generator().manual_seed(3)).tolist()
    full = full_logits(ours, ids)
    assert rel_err(full, full_logits(hf, ids)) < TOL  # the cache-free path is transformers' forward
    # pages of 4 tokens; prefill chunks of 5 (few-row attention) and of 20 (the SDPA path, from
    # position 0 and from 20): chunks and decode steps straddle page boundaries
    for chunk, prompt in ((5, 13), (20, 41)):
        engine = Engine(ours, cache_lens=64, page_size=4, chunk_size=chunk)
        seq = engine.new_sequence()
        got = [engine.prefill(seq, ids[:prompt])[0]]
        got += [engine.decode(seq, t)[0] for t in ids[prompt:-1]]
        assert seq.length == len(ids) - 1 and len(seq.pages) == 13
        err = rel_err(torch.stack(got), full[prompt - 1:-1])
        assert err < TOL, f"{family}, chunks of {chunk}: cached vs full {err:.2e}"


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe", "gpt_oss", "glm4_moe", "minimax_m2"])
def test_cached_decode_with_cpu_kernels(tmp_path, family):
    """The shipped rules (C++ experts and linears, int8 activations) agree with their own recompute."""
    ours, hf = load(tmp_path, family, reference_ops=False, types=GGMLType.Q8_0)
    ids = torch.randint(0, hf.config.vocab_size, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    full = full_logits(ours, ids)
    engine = Engine(ours, cache_lens=32, page_size=4, chunk_size=3)
    seq = engine.new_sequence()
    got = [engine.prefill(seq, ids[:7])[0]] + [engine.decode(seq, t)[0] for t in ids[7:-1]]
    assert rel_err(torch.stack(got), full[6:-1]) < 1e-2


@pytest.mark.parametrize("family", ["deepseek_v3", "mixtral"])
def test_batched_sequences_equal_alone(tmp_path, family):
    """Two sequences of different lengths in one packed step give what each gives alone."""
    ours, _ = load(tmp_path, family)
    gen = torch.Generator().manual_seed(5)
    a, b = (torch.randint(0, ours.config.vocab_size, (n,), generator=gen).tolist() for n in (9, 5))
    engine = Engine(ours, cache_lens=64, page_size=4)
    sa, sb = engine.new_sequence(), engine.new_sequence()
    logits = engine.step([sa, sb], [a[:6], b[:3]])  # mixed prefill of both
    logits2 = engine.step([sa, sb], [a[6:], b[3:]])  # then a multi-token and a 2-token chunk
    assert rel_err(logits[0], full_logits(ours, a[:6])[-1]) < TOL
    assert rel_err(logits[1], full_logits(ours, b[:3])[-1]) < TOL
    assert rel_err(logits2[0], full_logits(ours, a)[-1]) < TOL
    assert rel_err(logits2[1], full_logits(ours, b)[-1]) < TOL
    # their pages interleave in the pool, yet reads follow each sequence's own page table
    assert set(sa.pages).isdisjoint(sb.pages) and max(sa.pages + sb.pages) == len(sa.pages) + len(sb.pages) - 1


def test_prefix_reuse_recomputes_only_the_new_tail(tmp_path):
    ours, hf = load(tmp_path, "deepseek_v3")
    ids = torch.randint(0, hf.config.vocab_size, (15,), generator=torch.Generator().manual_seed(6)).tolist()
    engine = Engine(ours, cache_lens=64, page_size=4)
    seq = engine.new_sequence()
    engine.prefill(seq, ids[:10])
    other = ids[:6] + [(t + 1) % hf.config.vocab_size for t in ids[6:15]]
    logits = engine.prefill(seq, other)
    assert engine.last_prefill_tokens == len(other) - 6 and seq.length == len(other)
    assert rel_err(logits[0], full_logits(ours, other)[-1]) < TOL


def test_engine_after_another_ones_decode_keeps_torch_threads(tmp_path):
    """CPU decode drops torch to one thread; an engine made after that keeps the count from before
    for its prefill (it took the one thread, and its prefill sums differed in the last bits)."""
    ours, _ = load(tmp_path, "qwen3_moe")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        first = Engine(ours, cache_lens=16, page_size=4)
        seq = first.new_sequence()
        first.prefill(seq, [1, 2, 3])
        first.decode(seq, 4)
        assert torch.get_num_threads() == 1
        second = Engine(ours, cache_lens=16, page_size=4)
        assert second.torch_threads == 2
        second.prefill(second.new_sequence(), [5, 6])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_step_times_count_the_steps(tmp_path):
    """Engine.step_times sums each step's issue and wait times (what bench.e2e reports), counts
    only steps that ran (not one refused for room), and starts over on reset()."""
    ours, _ = load(tmp_path, "qwen3_moe")
    engine = Engine(ours, cache_lens=8, page_size=4)
    seq = engine.new_sequence()
    engine.prefill(seq, list(range(5)))
    engine.decode(seq, 3)
    times = engine.step_times
    assert times.steps == 2 and times.issue_s > 0 and times.wait_s >= 0
    with pytest.raises(CacheFullError):
        engine.step([seq], [[1, 2, 3]])
    assert times.steps == 2
    times.reset()
    engine.decode(seq, 4)
    assert times.steps == 1 and times.issue_s > 0


def test_cache_full_is_a_clear_error_and_changes_nothing(tmp_path):
    ours, _ = load(tmp_path, "qwen3_moe")
    engine = Engine(ours, cache_lens=8, page_size=4)
    seq = engine.new_sequence()
    with pytest.raises(CacheFullError, match="--cache_lens"):
        engine.prefill(seq, list(range(9)))
    engine.prefill(seq, list(range(6)))
    with pytest.raises(CacheFullError, match="--cache_lens"):
        engine.step([seq], [[1, 2, 3]])
    assert seq.length == 6 and len(seq.pages) == 2  # the failed step reserved nothing
    engine.release(seq)
    out = engine.generate(list(range(7)), max_new_tokens=50)
    list(out)
    assert out.finish_reason == "cache_full" and len(out.tokens) == 2  # slots 8: 7 prompt + 1 decoded + last


def test_paged_cache_bookkeeping():
    cache = PagedCache(num_layers=1, entry_shapes=[(3,)], cache_lens=10, page_size=4, dtype=torch.float32)
    assert cache.capacity == 12 and cache.free_tokens == 12
    s = cache.new_sequence()
    batch = cache.prepare([s], [5])
    assert s.pages == [0, 1] and batch.slots.tolist() == [0, 1, 2, 3, 4] and batch.positions.tolist() == list(range(5))
    values = torch.randn(5, 3)
    cache.write(0, batch, values)
    t = cache.new_sequence()
    batch = cache.prepare([s, t], [1, 2])
    assert t.pages == [2] and batch.slots.tolist() == [5, 8, 9] and batch.starts == [5, 0]
    for seq in (s, t):  # the host's slot arithmetic (CUDA-graph inputs) agrees with the slot tensors
        assert [cache.slot(seq, i) for i in range(seq.length)] == seq.slots[:seq.length].tolist()
    new = torch.randn(3, 3)
    cache.write(0, batch, new)
    assert torch.equal(cache.read(0, batch, 0)[0], torch.cat([values, new[:1]]))
    assert torch.equal(cache.read(0, batch, 1)[0], new[1:])
    cache.truncate(s, 3)
    assert s.pages == [0] and s.length == 3 and cache.free_tokens == 4
    cache.free(t)
    assert cache.free_tokens == 8
    with pytest.raises(ValueError):
        cache.prepare([s], [0])


def test_cache_shapes_follow_the_architecture():
    ds, qw = tiny_model("deepseek_v3").config, tiny_model("qwen3_moe").config
    mla = KDeepSeekV3Cache(ds, cache_lens=16, page_size=8)
    assert mla.layers[0][0].shape == (16, ds.kv_lora_rank + ds.qk_rope_head_dim) and len(mla.layers) == 3
    gqa = KGQACache(qw, cache_lens=16, page_size=8)
    assert [t.shape for t in gqa.layers[0]] == [(16, 2, 64), (16, 2, 64)]


def test_engine_needs_cached_attention(tmp_path):
    model = tiny_model("qwen3_moe", layers=2)
    write_gguf(tmp_path / "m.gguf", model.config, model.state_dict(), types=GGMLType.F32)
    text = (RULES_DIR / RULES["qwen3_moe"]).read_text()
    rules = text.split("- match:")
    (tmp_path / "r.yaml").write_text("- match:".join(r for r in rules if "self_attn" not in r))
    ours = build_skeleton(model.config, torch.float32)
    optimize_and_load_gguf(ours, tmp_path / "r.yaml", tmp_path / "m.gguf", model.config)
    with pytest.raises(ValueError, match="self_attn"):
        Engine(ours)


@pytest.fixture(scope="module")
def chat_engine(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("chat")
    ours, _ = load(tmp_path, "qwen3_moe", tokenizer=train_tokenizer(320))
    return Engine(ours, train_tokenizer(320), cache_lens=256, page_size=16)


def test_greedy_and_seeded_sampling_are_deterministic(chat_engine):
    prompt = chat_engine.tokenizer("the quick brown fox")["input_ids"]
    runs = [chat_engine.generate(prompt, SamplingParams(do_sample=False), 12) for _ in range(2)]
    texts = ["".join(r) for r in runs]
    assert texts[0] == texts[1] and len(runs[0].tokens) == 12 and runs[0].finish_reason == "length"
    assert runs[0].tokens[0] == int(chat_engine.prefill(chat_engine.new_sequence(), prompt).argmax())
    sampled = [chat_engine.generate(prompt, SamplingParams(temperature=1.5, seed=s), 16) for s in (7, 7, 8)]
    tokens = [(list(r), r.tokens)[1] for r in sampled]
    assert tokens[0] == tokens[1] and tokens[0] != tokens[2]


def test_stop_strings_and_eos(chat_engine):
    prompt = chat_engine.tokenizer("hello world")["input_ids"]
    free = chat_engine.generate(prompt, SamplingParams(do_sample=False), 20)
    text = "".join(free)
    assert len(text) > 4
    stop = text[2:4]  # a stop string that appears early in the free answer
    stopped = chat_engine.generate(prompt, SamplingParams(do_sample=False), 20, stop=[stop])
    out = "".join(stopped)
    assert stopped.finish_reason == "stop" and out == text[:text.index(stop)]
    # the first generated token made an EOS: generation ends on it, emitting nothing for it
    chat_engine.model.generation_config.eos_token_id = free.tokens[0]
    try:
        eos = chat_engine.generate(prompt, SamplingParams(do_sample=False), 20)
        assert "".join(eos) == "" and eos.tokens == free.tokens[:1] and eos.finish_reason == "stop"
    finally:
        chat_engine.model.generation_config.eos_token_id = None


def test_stats_lines_use_upstream_wording(chat_engine):
    run = chat_engine.generate(chat_engine.tokenizer("hello")["input_ids"], SamplingParams(do_sample=False), 5)
    list(run)
    lines = run.stats.lines()
    assert [line.split(":")[0] for line in lines] == ["prompt eval count", "prompt eval duration", "prompt eval rate",
                                                      "eval count", "eval duration", "eval rate"]
    assert lines[0] == f"prompt eval count:    {run.stats.prompt_tokens} token(s)" and run.stats.eval_tokens == 5
    assert lines[3] == "eval count:           5 token(s)"
    assert re.fullmatch(r"eval duration:        \d+\.\d\ds", lines[4])
    assert re.fullmatch(r"eval rate:            \d+\.\d\d tokens/s", lines[5])


def test_sliding_window_matches_transformers(tmp_path):
    """Mixtral with a window shorter than the sequence: cached decode masks what transformers masks."""
    from tiny import tiny_config
    from transformers import AutoModelForCausalLM
    config = tiny_config("mixtral", layers=2)
    config.sliding_window = 6
    torch.manual_seed(1)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * (0.02 if p.dim() > 1 else 0.1) + (1.0 if p.dim() == 1 else 0.0))
    write_gguf(tmp_path / "m.gguf", config, hf.state_dict(), types=GGMLType.F32)
    ours = build_skeleton(config, torch.float32)
    optimize_and_load_gguf(ours, reference_rules("mixtral", tmp_path), tmp_path / "m.gguf", config)
    ids = torch.randint(0, config.vocab_size, (16,), generator=torch.Generator().manual_seed(2)).tolist()
    full = full_logits(hf, ids)
    assert rel_err(full_logits(ours, ids), full) < TOL
    attention = [m for m in ours.modules() if hasattr(m, "window")]
    for m in attention:
        m.window = None
    windowless = full_logits(ours, ids)
    for m in attention:
        m.window = 6
    assert rel_err(windowless, full) > 1e-3  # the window matters for this input (else the test proves nothing)
    engine = Engine(ours, cache_lens=32, page_size=4, chunk_size=5)
    seq = engine.new_sequence()
    got = [engine.prefill(seq, ids[:9])[0]] + [engine.decode(seq, t)[0] for t in ids[9:-1]]
    assert rel_err(torch.stack(got), full[8:-1]) < TOL


def test_failed_prefill_frees_its_pages(tmp_path):
    ours, _ = load(tmp_path, "qwen3_moe")
    engine = Engine(ours, cache_lens=16, page_size=4, chunk_size=4)
    holder = engine.new_sequence()
    engine.prefill(holder, list(range(8)))  # half the pages taken by another sequence
    with pytest.raises(CacheFullError):
        list(engine.generate(list(range(12)), max_new_tokens=2))  # its later chunks cannot fit
    assert engine.cache.free_tokens == 8  # what the failed answer reserved came back


def test_gqa_torch_decode_path_equals_the_cpp_one(tmp_path):
    """Decode through the torch reference attention (no C++ runtime) and through the extension."""
    from ktransformers.operators.attention import KGQAAttention
    ours, hf = load(tmp_path, "qwen3_moe")
    ids = torch.randint(0, hf.config.vocab_size, (30,), generator=torch.Generator().manual_seed(8)).tolist()
    layers = [m for m in ours.modules() if isinstance(m, KGQAAttention)]
    runtimes = [m._runtime for m in layers]
    assert all(r is not None for r in runtimes)
    results = []
    for use_cpp in (True, False):
        for m, r in zip(layers, runtimes):
            m._runtime = r if use_cpp else None
        engine = Engine(ours, cache_lens=64, page_size=8)
        seq = engine.new_sequence()
        results.append(torch.stack([engine.prefill(seq, ids[:20])[0]] + [engine.decode(seq, t)[0] for t in ids[20:]]))
    assert rel_err(results[0], results[1]) < 1e-5
    assert rel_err(results[1][:-1], full_logits(ours, ids)[19:-1]) < TOL


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss", "glm4_moe", "minimax_m2"])
def test_cpu_decode_layer_equals_module_by_module(tmp_path, family):
    """KDecoderLayer's CPU decode step (the layer's kernels called back to back) gives the same
    logits, to the bit, as the same layer run module by module, across page boundaries and
    sliding windows (gpt-oss's window of 8, its sinks and biases; Qwen2-MoE's and GLM's shared
    experts; MiniMax-M2's q/k norms over all heads; GLM's partial rotary); prefill and steps of
    two sequences go through transformers' own layer forward; with torch reference operators
    inside, the layer never takes the CPU path."""
    from torch import nn

    from ktransformers.operators.layer import KDecoderLayer
    ours, hf = load(tmp_path, family, reference_ops=False, types=GGMLType.Q8_0)
    layers = [m for m in ours.modules() if isinstance(m, KDecoderLayer)]
    assert len(layers) == hf.config.num_hidden_layers
    took = record_cpu_steps(layers)
    moe_layers = [m for m in layers if hasattr(m.mlp, "experts")]  # (GLM's first layer is dense)
    assert moe_layers
    ids = torch.randint(0, hf.config.vocab_size, (40,), generator=torch.Generator().manual_seed(12)).tolist()
    results = logits_of_both_plans(ours, layers, ids, 13)
    # every decode step, every MoE layer (a dense layer returns before it is recorded: no plan)
    assert sum(took) == len(moe_layers) * (len(ids) - 13)
    assert torch.equal(results[0], results[1])
    # two sequences in one step: the module-by-module path, each as when alone
    for m in layers:
        m.cpu_decode = True
    assert all(m.plan.cpu_decode is not None for m in moe_layers)
    two_at_once_as_alone(ours, ids, took)
    reference, _ = load(tmp_path, family)  # torch reference operators: no CPU path to take
    engine = Engine(reference, cache_lens=64, page_size=4)
    seq = engine.new_sequence()
    engine.prefill(seq, ids[:5])
    engine.decode(seq, ids[5])
    assert all(m.plan.cpu_decode is None for m in reference.modules() if isinstance(m, KDecoderLayer))
    with pytest.raises(ValueError, match="not a pre-norm decoder layer"):
        KDecoderLayer("model.layers.0", None, hf.config, nn.Linear(2, 2))


def test_segments_of_runs_of_layers():
    """The decode graphs' device segments: runs of consecutive layers on one GPU, in order."""
    from ktransformers.engine.graphs import segments_of
    a, b = torch.device("cuda", 0), torch.device("cuda", 1)
    assert segments_of([a, a, b, b, b]) == [(a, range(0, 2)), (b, range(2, 5))]
    assert segments_of([a]) == [(a, range(0, 1))]
    assert segments_of([a, b, a]) == [(a, range(0, 1)), (b, range(1, 2)), (a, range(2, 3))]


def test_greedy_tokens_equal_decode_and_argmax(tmp_path):
    """Engine.greedy_tokens (what greedy generation uses) gives decode()'s argmax token by token,
    records the tokens it fed, and stops at its limit or where the cache cannot grow."""
    ours, _ = load(tmp_path, "qwen3_moe")
    engine = Engine(ours, cache_lens=32, page_size=4)
    prompt = torch.randint(3, 200, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    ref_seq = engine.new_sequence()
    token = int(engine.prefill(ref_seq, prompt)[0].argmax())
    want = []
    t = token
    for _ in range(6):
        t = int(engine.decode(ref_seq, t)[0].argmax())
        want.append(t)
    seq = engine.new_sequence()
    assert int(engine.prefill(seq, prompt)[0].argmax()) == token
    it = engine.greedy_tokens(seq, token, 6)
    got = [next(it) for _ in range(4)]
    it.close()  # early: what it fed is cached and recorded, nothing more
    assert got == want[:4]
    assert engine.cached_tokens(seq) == prompt + [token] + got[:3] and seq.length == len(prompt) + 4
    assert list(engine.greedy_tokens(seq, got[-1], 2)) == want[4:6]
    engine.release(ref_seq)
    room = 32 - seq.length
    assert len(list(engine.greedy_tokens(seq, want[5], 100))) == room and seq.length == 32  # to the cache's end


def test_sampled_decode_tokens_equal_decode_and_draw(tmp_path):
    """Engine.decode_tokens with a sampler (what sampled generation without a repetition penalty
    uses) gives decode() and the sampler's draw token by token, for the same seed."""
    from ktransformers.engine.sampling import Sampler, SamplingParams
    ours, _ = load(tmp_path, "qwen3_moe")
    engine = Engine(ours, cache_lens=64, page_size=4)
    prompt = torch.randint(3, 200, (9,), generator=torch.Generator().manual_seed(6)).tolist()
    params = SamplingParams(temperature=1.5, top_k=50, seed=3)
    runs = []
    for stepwise in (True, False):
        seq, sampler = engine.new_sequence(), Sampler(params)
        token = int(sampler(engine.prefill(seq, prompt))[0])
        if stepwise:
            got = []
            for _ in range(8):
                token = int(sampler(engine.decode(seq, token))[0])
                got.append(token)
        else:
            got = list(engine.decode_tokens(seq, token, 8, sampler))
        runs.append((got, engine.cached_tokens(seq)))
        if not stepwise:  # a draw with nothing to draw from: ValueError, its step dropped
            bad = Sampler(params)
            bad.pick = lambda logits, prev=None: (logits.argmax(-1), torch.zeros(1, dtype=torch.bool))
            before = (seq.length, list(engine.cached_tokens(seq)))
            with pytest.raises(ValueError, match="nothing to sample"):
                list(engine.decode_tokens(seq, got[-1], 3, bad))
            assert (seq.length, list(engine.cached_tokens(seq))) == before
        engine.release(seq)
    assert runs[0] == runs[1] and len(set(runs[0][0])) > 2
