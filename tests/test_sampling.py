"""Sampler against argmax, torch.multinomial and empirical distributions; StreamDecoder against
a real byte-level BPE tokenizer's full decode; StopMatcher on stop strings split across pieces."""
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast

from ktransformers.engine.sampling import Sampler, SamplingParams, filter_top_k, filter_top_p
from ktransformers.engine.streaming import StopMatcher, StreamDecoder


def draws(params: SamplingParams, logits: torch.Tensor, n: int) -> torch.Tensor:
    """[n, B] tokens from n calls of one Sampler."""
    sampler = Sampler(params)
    return torch.stack([sampler(logits) for _ in range(n)])


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("V", [7, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax(B, V, dtype):
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(B * V)).to(dtype)
    want = logits.float().argmax(-1)
    for params in (SamplingParams(do_sample=False), SamplingParams(temperature=0.0)):
        got = Sampler(params)(logits)
        assert got.dtype == torch.int64 and got.shape == (B,)
        assert torch.equal(got, want)


def test_seed_reproducible_and_seeds_differ():
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    a = draws(SamplingParams(seed=123), logits, 50)
    torch.manual_seed(999)  # the global RNG must not matter
    b = draws(SamplingParams(seed=123), logits, 50)
    c = draws(SamplingParams(seed=124), logits, 50)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("params", [SamplingParams(top_k=1, seed=0), SamplingParams(top_p=1e-6, seed=0)])
def test_tight_filters_equal_greedy(params):
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(1)) * 0.1  # nearly flat
    assert (draws(params, logits, 30) == logits.argmax(-1)).all()


def test_top_k_restricts_to_top_set():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(2))
    got = draws(SamplingParams(top_k=5, seed=0), logits, 500)  # [n, B]
    top = logits.topk(5, dim=-1).indices
    for b in range(2):
        seen = set(got[:, b].tolist())
        assert seen <= set(top[b].tolist())
        assert len(seen) > 1  # it still samples
    # top_k larger than V is just "off"
    assert draws(SamplingParams(top_k=10_000, seed=0), logits, 5).shape == (5, 2)


def test_top_p_keeps_smallest_nucleus():
    # probs 0.5, 0.3, 0.15, 0.05: top_p=0.8 keeps exactly the first two
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    got = set(draws(SamplingParams(top_p=0.8, seed=0), logits, 400).flatten().tolist())
    assert got == {0, 1}


def test_low_temperature_concentrates_on_argmax():
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5]])
    hot = (draws(SamplingParams(temperature=1.0, seed=0), logits, 400) == 0).float().mean()
    cold = (draws(SamplingParams(temperature=0.05, seed=0), logits, 400) == 0).float().mean()
    assert hot < 0.6 and cold > 0.99


def test_neg_inf_logits_never_sampled():
    logits = torch.full((2, 10), float("-inf"))
    logits[0, 3], logits[0, 7], logits[1, 9] = 0.0, 0.0, 5.0
    got = draws(SamplingParams(seed=0, top_p=0.9, top_k=4), logits, 100)
    assert set(got[:, 0].tolist()) <= {3, 7} and set(got[:, 1].tolist()) == {9}
    with pytest.raises(ValueError, match="logits"):
        Sampler(SamplingParams(seed=0))(torch.full((1, 4), float("-inf")))


def test_repetition_penalty_moves_argmax():
    logits = torch.tensor([[3.0, 2.0, -1.0], [3.0, 2.0, -1.0]])
    before = logits.clone()
    got = Sampler(SamplingParams(do_sample=False, repetition_penalty=2.0))(logits, [[0], [2, 2]])
    assert got.tolist() == [1, 0]  # row 0: 3/2 < 2; row 1: only the negative logit was penalised
    assert torch.equal(logits, before)  # caller's tensor untouched
    with pytest.raises(ValueError, match="prev_tokens"):
        Sampler(SamplingParams(repetition_penalty=2.0))(logits, [[0]])


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
])
def test_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_from_generation_config():
    assert SamplingParams.from_generation_config(None) == SamplingParams()
    gc = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.95, top_k=20)
    p = SamplingParams.from_generation_config(gc, temperature=None, top_k=5, seed=7)
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.repetition_penalty) == (0.6, 0.95, 5, 7, 1.0)
    assert SamplingParams.from_generation_config(GenerationConfig(do_sample=False)).greedy
    with pytest.raises(ValueError, match="overrides"):
        SamplingParams.from_generation_config(None, temprature=0.5)


# --- StreamDecoder --------------------------------------------------------------------------------

TEXTS = ["héllo wörld 日本語 🙂", "hello world, hello there", "naïve café 🙂🙂 日本", "wörld 語 done."]


@pytest.fixture(scope="module")
def bpe() -> PreTrainedTokenizerFast:
    """A tiny byte-level BPE: few merges, so multi-byte characters stay split across tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + 20, initial_alphabet=alphabet,
                                  special_tokens=["<eos>"])
    tok.train_from_iterator(TEXTS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def stream(tokenizer, ids: list[int]) -> tuple[list[str], str]:
    dec = StreamDecoder(tokenizer)
    pieces = [dec.push(i) for i in ids]
    tail = dec.flush()
    assert dec.text == "".join(pieces) + tail
    return pieces, tail


@pytest.mark.parametrize("text", TEXTS + [" ".join(TEXTS)])
def test_stream_decoder_matches_full_decode(bpe, text):
    ids = bpe.encode(text)
    if not text.isascii():
        assert any("\ufffd" in bpe.decode([i]) for i in ids)  # the test really splits characters
    pieces, tail = stream(bpe, ids)
    assert "".join(pieces) + tail == bpe.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces) and tail == ""


def test_stream_decoder_emoji_one_byte_per_token(bpe):
    byte_chars = bpe.backend_tokenizer.pre_tokenizer.pre_tokenize_str("🙂")[0][0]  # one char per byte
    ids = bpe.convert_tokens_to_ids(list(byte_chars))
    assert len(ids) == 4 and bpe.unk_token_id not in ids
    pieces, tail = stream(bpe, bpe.encode("a") + ids + bpe.encode("b"))
    assert pieces == ["a", "", "", "", "🙂", "b"] and tail == ""
    # ended mid-character: flush releases what there is
    pieces, tail = stream(bpe, ids[:2])
    assert pieces == ["", ""] and tail and set(tail) == {"\ufffd"}


def test_stream_decoder_decodes_a_bounded_window(bpe):
    widths = []

    class Counting:
        def decode(self, ids, **kwargs):
            widths.append(len(ids))
            return bpe.decode(ids, **kwargs)

    ids = bpe.encode(" ".join(TEXTS) * 20)
    pieces, tail = stream(Counting(), ids)
    assert "".join(pieces) + tail == bpe.decode(ids)
    assert max(widths) <= 8  # a few tokens around one character, never the whole sequence


def test_stream_decoder_skips_special_tokens(bpe):
    ids = bpe.encode("hello") + [bpe.eos_token_id]
    pieces, tail = stream(bpe, ids)
    assert "".join(pieces) + tail == "hello"


# --- StopMatcher ----------------------------------------------------------------------------------

def run_stop(stop: list[str], pieces: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stop)
    out = []
    for p in pieces:
        text, stopped = m.push(p)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + m.flush(), False


def test_stop_split_across_three_pieces():
    m = StopMatcher(["<|end|>"])
    assert m.push("answer <|") == ("answer ", False)
    assert m.push("en") == ("", False)
    assert m.push("d|> trailing") == ("", True)
    assert m.push("more") == ("", True)


def test_stop_at_start():
    assert run_stop(["STOP"], ["STOP", "after"]) == ("", True)
    assert run_stop(["STOP"], ["ST", "OP"]) == ("", True)


def test_stop_one_prefix_of_another():
    assert run_stop(["##", "###"], ["x#", "#", "#y"]) == ("x", True)
    assert run_stop(["abc", "ab"], ["xa", "bc"]) == ("x", True)
    assert run_stop(["bc", "abcd"], ["a", "b", "c"]) == ("a", True)  # earliest complete match wins


def test_no_stop_emits_everything():
    pieces = ["hello ", "wor", "ld <", "|e"]
    assert run_stop(["<|end|>"], pieces) == ("".join(pieces), False)


def test_held_back_text_released():
    m = StopMatcher(["<|end|>"])
    assert m.push("a <|en") == ("a ", False)
    assert m.push("tropy") == ("<|entropy", False)
    assert m.push("<<|") == ("<", False)  # "<" can no longer start the stop; "<|" still can
    assert m.flush() == "<|"


def test_stop_validation():
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(["ok", ""])
    with pytest.raises(TypeError, match="sequence"):
        StopMatcher("</s>")


def multinomial_draws(params: SamplingParams, logits: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """[n, B]: the filtered distribution of each row drawn n times by torch.multinomial."""
    shifted = logits.float() - logits.float().amax(-1, keepdim=True)
    probs = filter_top_p(filter_top_k(shifted / params.temperature, params.top_k), params.top_p).softmax(-1)
    return torch.stack([torch.multinomial(probs, 1, generator=gen).squeeze(-1) for _ in range(n)])


@pytest.mark.parametrize("B, V, params", [(1, 7, SamplingParams(seed=3)),
                                          (3, 500, SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=11)),
                                          (2, 1000, SamplingParams(temperature=1.3, top_p=0.5, seed=5))])
def test_draw_is_multinomial(B, V, params):
    """A draw is torch.multinomial's own (p / q, q ~ Exp(1), argmax) without its host-side check:
    the same tokens from a generator of the same seed."""
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(V)) * 3
    got = draws(params, logits, 30)
    assert torch.equal(got, multinomial_draws(params, logits, 30, torch.Generator().manual_seed(params.seed)))


def test_pick_flags_rows_with_nothing_to_sample():
    """pick reads nothing back: a row of -inf or NaN comes back flagged (its token meaningless)
    where the call raises."""
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(4))
    logits[1] = float("-inf")
    logits[2, 5] = float("nan")
    logits[3, 7] = float("inf")
    tokens, valid = Sampler(SamplingParams(seed=0)).pick(logits)
    assert valid.tolist() == [True, False, False, False] and tokens.shape == (4,) and 0 <= int(tokens[0]) < 20
    with pytest.raises(ValueError, match="nothing to sample"):
        Sampler(SamplingParams(seed=0))(logits[3:])
    assert Sampler(SamplingParams(do_sample=False)).pick(logits)[1] is None  # greedy: an argmax, no flag


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampling_gpu_logits_drawn_on_the_gpu(monkeypatch):
    """A GPU engine's logits are drawn on the GPU, by a generator there with the sampler's seed
    (the same tokens as torch.multinomial with it), by a captured CUDA graph that gives the eager
    draw's tokens, and `pick` does not wait for the GPU."""
    from ktransformers.engine import sampling
    monkeypatch.setattr(sampling, "_DRAW_GRAPHS", {})  # (this test's captures, not earlier tests')
    logits = (torch.randn(3, 500, generator=torch.Generator().manual_seed(2)) * 3).cuda()
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=11)
    got = draws(params, logits, 20)
    assert got.device == logits.device
    gen = torch.Generator(device=logits.device).manual_seed(11)
    assert torch.equal(got, multinomial_draws(params, logits, 20, gen))
    assert any(k[0] == logits.device and g is not None for k, g in sampling._DRAW_GRAPHS.items())  # (captured)
    real_draw_graph = sampling._draw_graph
    for dtype in (torch.float32, torch.bfloat16):  # the captured draw is the eager one
        runs = []
        for graph in (False, True):  # (eager: as where no graph can be captured)
            monkeypatch.setattr(sampling, "_draw_graph", real_draw_graph if graph else lambda logits, p: None)
            runs.append(draws(params, logits.to(dtype), 10))
        assert torch.equal(runs[0], runs[1]), dtype
    sampler = Sampler(params)
    sampler.pick(logits)  # (the GPU generator made outside the check below)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any op that waits for the GPU raises
    try:
        tokens, valid = sampler.pick(logits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert bool(valid.all()) and tokens.shape == (3,)
