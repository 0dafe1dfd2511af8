"""The server's scheduler without HTTP, on the bundled demo model: answers (greedy and seeded
draws) equal those of `Engine.generate` (local_chat's path) alone and in a batch of prompts of
different lengths, with decode steps run ahead or one at a time (on the CPU a step "in flight" has
already run, but the scheduler's bookkeeping is the GPU's: what is issued before it is read, what
a request ending or cancelled mid-flight leaves), and a long prompt is read in bounded chunks
between the running requests' decode steps."""
import time

import pytest
from tiny import wait_all

from ktransformers.demo import DEMO_GGUF, DEMO_HF_DIR
from ktransformers.engine.generate import Engine
from ktransformers.engine.sampling import SamplingParams
from ktransformers.loader import load_model
from ktransformers.server.scheduler import Request, Scheduler

GREEDY = SamplingParams(do_sample=False)


@pytest.fixture(scope="module")
def engine():
    lm = load_model(DEMO_GGUF, DEMO_HF_DIR, cpu_infer=2, progress=False)
    return Engine(lm.model, lm.tokenizer, cache_lens=2048, page_size=16, chunk_size=24)


def prompts_of(engine, n):
    words = "the quick brown fox jumps over the lazy dog and then it rains in the city".split()
    return [engine.tokenizer(" ".join(words[:3 + 2 * i % len(words)]) + f" part {i}")["input_ids"] for i in range(n)]


def params_of(i: int) -> SamplingParams:
    return GREEDY if i % 2 == 0 else SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i)


@pytest.mark.parametrize("run_ahead", [False, True])
def test_tokens_equal_generate_alone_and_in_a_batch(engine, run_ahead):
    prompts = prompts_of(engine, 8)
    expected = [list(engine.generate(p, params_of(i), 12).token_ids()) for i, p in enumerate(prompts)]
    sched = Scheduler(engine, engine.tokenizer, max_batch=8, prefix_cache=False, run_ahead=run_ahead)
    try:
        alone = Request(prompts[0], GREEDY, 12)
        sched.submit(alone)
        wait_all([alone])
        batch = [Request(p, params_of(i), 12) for i, p in enumerate(prompts)]
        for r in batch:
            sched.submit(r)
        wait_all(batch)
    finally:
        sched.close()
    assert alone.tokens == expected[0]
    assert [r.tokens for r in batch] == expected
    assert len({len(p) for p in prompts}) > 4  # prompts of different lengths shared the steps
    assert len(engine.cache._free) == engine.cache.num_pages  # every page given back


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_requests_ending_and_cancelled_while_a_step_runs_ahead(engine, prefix_cache):
    """Requests that end on a stop token, at max_tokens and by cancellation while the next step,
    which holds an entry for them, is in flight: each gets exactly its tokens, the others go on
    unchanged, and the cache's bookkeeping stays whole (no page lost; a kept sequence's tokens
    are its entries)."""
    prompts = prompts_of(engine, 4)
    expected = [list(engine.generate(p, GREEDY, 16).token_ids()) for p in prompts]
    sched = Scheduler(engine, engine.tokenizer, max_batch=4, prefix_cache=prefix_cache, run_ahead=True)
    # a token that first comes a few steps in, so that the request ends with a step in flight
    k, varied = next((k, i) for i in (1, 2, 3, 0) for k in range(4, 12) if expected[i][k] not in expected[i][:k])
    try:
        reqs = [Request(prompts[varied], GREEDY, 16, stop_ids=frozenset({expected[varied][k]})),
                Request(prompts[1], GREEDY, 7),
                Request(prompts[2], GREEDY, 16, ignore_eos=True),
                Request(prompts[3], GREEDY, 16, ignore_eos=True)]
        for r in reqs:
            sched.submit(r)
        while len(reqs[2].tokens) < 3:
            time.sleep(0.001)
        reqs[2].cancel()
        wait_all(reqs)
    finally:
        sched.close()
    assert reqs[0].tokens == expected[varied][:k + 1] and reqs[0].finish_reason == "stop"
    assert reqs[1].tokens == expected[1][:7] and reqs[1].finish_reason == "length"
    assert reqs[2].finish_reason == "cancelled" and reqs[2].tokens == expected[2][:len(reqs[2].tokens)]
    assert reqs[3].tokens == expected[3] and reqs[3].finish_reason == "length"
    cache = engine.cache
    kept = list(sched.pool._seqs.values()) if prefix_cache else []
    assert len(cache._free) + sum(len(s.pages) for s in kept) == cache.num_pages
    for seq in kept:
        assert len(engine.cached_tokens(seq)) == seq.length
    if sched.pool is not None:
        sched.pool.clear()
    assert len(cache._free) == cache.num_pages


@pytest.mark.parametrize("run_ahead", [False, True])
def test_a_long_prompt_is_read_in_bounded_chunks_between_decode_steps(engine, monkeypatch, run_ahead):
    """While a newcomer's long prompt is read, no forward computes more than chunk_size tokens,
    and the running requests get a decode step between every two of its chunks."""
    forwards = []
    real_step = engine.step

    def recorded(seqs, new_tokens):
        forwards.append([len(t) for t in new_tokens])
        return real_step(seqs, new_tokens)
    monkeypatch.setattr(engine, "step", recorded)
    sched = Scheduler(engine, engine.tokenizer, max_batch=4, prefix_cache=False, run_ahead=run_ahead)
    try:
        running = [Request(p, GREEDY, 60, ignore_eos=True) for p in prompts_of(engine, 3)]
        for r in running:
            sched.submit(r)
        while any(len(r.tokens) < 2 for r in running):
            time.sleep(0.005)
        long_prompt = [engine.tokenizer.eos_token_id or 1] + prompts_of(engine, 1)[0] * 30
        newcomer = Request(long_prompt, GREEDY, 4, ignore_eos=True)
        sched.submit(newcomer)
        wait_all(running + [newcomer])
    finally:
        sched.close()
    chunks = [i for i, f in enumerate(forwards) if f[0] > 1]  # prefill forwards (one prompt's chunk each)
    newcomer_chunks = [i for i in chunks if i > chunks[2]]  # after the three first prompts' own
    assert len(long_prompt) > 4 * engine.chunk_size and len(newcomer_chunks) >= 4
    assert all(max(f) <= engine.chunk_size for f in forwards)
    for a, b in zip(newcomer_chunks, newcomer_chunks[1:]):
        between = forwards[a + 1:b]
        assert any(len(f) == 3 and max(f) == 1 for f in between), (a, b, between)  # the three decoding
    assert all(len(r.tokens) == 60 for r in running) and len(newcomer.tokens) == 4


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_a_full_cache_preempts_and_resumes_instead_of_cutting_short(prefix_cache):
    """Six requests whose answers together need twice the cache's pages: each is admitted when its
    prompt fits, and when decode runs out of pages the newest ones are preempted (their full pages
    kept in the prefix tiers) and resume later where they were. Every answer is whole and equals
    its answer alone; no page is lost."""
    from ktransformers.cache.prefix import PrefixStore
    lm = load_model(DEMO_GGUF, DEMO_HF_DIR, cpu_infer=2, progress=False)
    engine = Engine(lm.model, lm.tokenizer, cache_lens=160, page_size=16, chunk_size=24)
    prompts = prompts_of(engine, 6)
    expected = [list(engine.generate(p, GREEDY, 40).token_ids()) for p in prompts]
    assert sum(len(p) + len(e) for p, e in zip(prompts, expected)) > 2 * engine.cache.capacity
    sched = Scheduler(engine, engine.tokenizer, max_batch=6, prefix_cache=prefix_cache,
                      prefix_store=PrefixStore(ram_bytes=1 << 28) if prefix_cache else None)
    try:
        reqs = [Request(p, GREEDY, 40) for p in prompts]
        for r in reqs:
            sched.submit(r)
        wait_all(reqs)
    finally:
        sched.close()
    assert sched.stats.preemptions > 0 and any(r.preempted for r in reqs)
    assert [r.finish_reason for r in reqs] == ["length" if len(e) == 40 else "stop" for e in expected]
    assert [r.tokens for r in reqs] == expected
    if sched.pool is not None:
        sched.pool.clear()
    assert len(engine.cache._free) == engine.cache.num_pages
