"""The server's scheduler without HTTP, on the bundled demo model: greedy answers equal those of
`Engine.generate` (local_chat's path) alone and in a batch of prompts of different lengths, and a
long prompt is read in bounded chunks between the running requests' decode steps."""
import time

import pytest

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


def wait_all(requests, timeout=300):
    deadline = time.monotonic() + timeout  # (a hang guard)
    while any(r.t_done is None for r in requests):
        assert time.monotonic() < deadline, "the scheduler did not finish"
        time.sleep(0.01)


def prompts_of(engine, n):
    words = "the quick brown fox jumps over the lazy dog and then it rains in the city".split()
    return [engine.tokenizer(" ".join(words[:3 + 2 * i % len(words)]) + f" part {i}")["input_ids"] for i in range(n)]


def test_greedy_tokens_equal_generate_alone_and_in_a_batch(engine):
    prompts = prompts_of(engine, 8)
    expected = [list(engine.generate(p, GREEDY, 12).token_ids()) for p in prompts]
    sched = Scheduler(engine, engine.tokenizer, max_batch=8, prefix_cache=False)
    try:
        alone = Request(prompts[0], GREEDY, 12)
        sched.submit(alone)
        wait_all([alone])
        batch = [Request(p, GREEDY, 12) for p in prompts]
        for r in batch:
            sched.submit(r)
        wait_all(batch)
    finally:
        sched.close()
    assert alone.tokens == expected[0]
    assert [r.tokens for r in batch] == expected
    assert len({len(p) for p in prompts}) > 4  # prompts of different lengths shared the steps


def test_a_long_prompt_is_read_in_bounded_chunks_between_decode_steps(engine, monkeypatch):
    """While a newcomer's long prompt is read, no forward computes more than chunk_size tokens,
    and the running requests get a decode step between every two of its chunks."""
    forwards = []
    real_step = engine.step

    def recorded(seqs, new_tokens):
        forwards.append([len(t) for t in new_tokens])
        return real_step(seqs, new_tokens)
    monkeypatch.setattr(engine, "step", recorded)
    sched = Scheduler(engine, engine.tokenizer, max_batch=4, prefix_cache=False)
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
