"""Grammar masks (engine/grammar.py) against the matcher itself: at each step of a JSON answer,
the tokens mask_rows leaves finite are the matcher's bitmask read bit by bit in plain Python,
all of them tokens the matcher takes when asked token by token (its mask may hold back a
non-canonical spelling of forced text, e.g. 'w' + 'ord' of a key), for rows of a batch on the
CPU and on CUDA; other rows' logits are untouched, and the vocabulary rows past the tokenizer's
are never allowed."""
import json

import pytest
import torch

pytest.importorskip("llguidance", reason="structured output needs llguidance")
from tiny import train_tokenizer  # noqa: E402

from ktransformers.engine.grammar import GrammarError, Grammars, grammars_for, mask_rows, tool_call_schema  # noqa: E402

SCHEMA = {"type": "object", "required": ["word", "n"], "additionalProperties": False,
          "properties": {"word": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}}}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(320)


def accepted(constraint, vocab: int) -> set[int]:
    """The tokens the matcher takes next, each tried alone (validate_tokens counts how many of the
    given tokens it would take)."""
    return {t for t in range(vocab) if constraint._matcher.validate_tokens([t]) == 1}


def bits(constraint, vocab: int) -> set[int]:
    """The tokens set in the matcher's own bitmask, read one bit at a time."""
    import llguidance.torch as lt
    words = lt.allocate_token_bitmask(1, vocab)
    constraint.fill(words, 0)
    return {t for t in range(vocab) if (int(words[0, t // 32]) >> (t % 32)) & 1}


@pytest.mark.parametrize("device", DEVICES)
def test_masked_tokens_are_exactly_those_the_matcher_takes(tok, device):
    vocab = 336  # (the model's vocabulary may be longer than the tokenizer's 320)
    grammars = grammars_for(tok, vocab, [tok.eos_token_id])
    answer = tok.encode('{"word":"the","n":42}')
    constraints = [grammars.json_schema(SCHEMA) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    for step, token in enumerate(answer + [tok.eos_token_id]):
        logits = torch.randn(3, vocab, generator=gen).to(device)
        before = logits.clone()
        mask_rows(logits, constraints, [0, 2])  # row 1: an unconstrained request of the batch
        want = bits(constraints[0], vocab)
        # (the stop token ends the answer rather than being taken: validate_tokens does not count it)
        assert want and want - {tok.eos_token_id} <= accepted(constraints[0], vocab) and max(want) < 320
        assert (tok.eos_token_id in want) == (step == len(answer))
        for row in (0, 2):
            finite = set(torch.isfinite(logits[row]).nonzero().flatten().tolist())
            assert finite == want, (step, row)
            assert torch.equal(logits[row][list(want)], before[row][list(want)])
        assert torch.equal(logits[1], before[1])
        for c in constraints:
            assert c.accept(token)
    assert all(c.done for c in constraints)


@pytest.mark.parametrize("device", DEVICES)
def test_a_tokenizer_longer_than_the_logits(tok, device):
    """A tokenizer that counts ids past the model's vocabulary (transformers may add tokens when it
    builds one from a GGUF): the grammar takes every id, the masks are cut to the logits' width."""
    vocab = len(tok) - 4
    grammars = grammars_for(tok, vocab, [tok.eos_token_id])
    constraint = grammars.json_schema(SCHEMA)
    want = {t for t in bits(constraint, len(tok)) if t < vocab}
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(1)).to(device)
    mask_rows(logits, [constraint], [1])
    assert want and set(torch.isfinite(logits[1]).nonzero().flatten().tolist()) == want
    assert torch.isfinite(logits[0]).all()


def test_forced_tool_call_schemas_and_bad_schemas(tok):
    grammars = grammars_for(tok, 320, [tok.eos_token_id])
    tools = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}},
             {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}]
    assert tool_call_schema(tools, "f", True) == SCHEMA
    many = tool_call_schema(tools, None, False)
    assert many["maxItems"] == 1 and {c["properties"]["name"]["const"] for c in many["items"]["anyOf"]} == {"f", "g"}
    c = grammars.json_schema(many)
    text = json.dumps([{"name": "f", "arguments": {"word": "dog", "n": 1}}], separators=(",", ":"))
    assert all(c.accept(t) for t in tok.encode(text)) and c.done
    wrong = grammars.json_schema(many)
    assert not all(wrong.accept(t) for t in tok.encode('[{"name":"h"'))
    with pytest.raises(GrammarError, match="JSON schema"):
        grammars.json_schema({"type": "object", "properties": {"x": {"type": "no-such-type"}}})


def test_requests_of_one_schema_share_its_compile_not_its_state(tok, monkeypatch):
    """A schema is compiled once (the same schema with its keys in another order too); each
    request's matcher starts from a copy of the compiled one's fresh state, so one request's
    tokens leave the next request's matcher at the start. The compiled schemas kept are bounded."""
    grammars = Grammars(tok, 320, [tok.eos_token_id])
    first = grammars.json_schema(SCHEMA)
    start = bits(first, 320)
    assert all(first.accept(t) for t in tok.encode('{"word":"th'))
    assert bits(first, 320) != start
    second = grammars.json_schema(dict(reversed(list(SCHEMA.items()))))
    assert len(grammars._templates) == 1 and bits(second, 320) == start
    assert all(second.accept(t) for t in tok.encode('{"word":"the","n":42}')) and second.done
    assert not first.done and bits(grammars.json_schema(SCHEMA), 320) == start
    grammars.json_schema(SCHEMA, strict=False)
    assert len(grammars._templates) == 2
    monkeypatch.setattr(Grammars, "TEMPLATES", 2)
    grammars.json_schema({"type": "array"})
    assert [strict for _, strict in grammars._templates] == [False, True]  # (the least recently used went)
